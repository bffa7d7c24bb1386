"""What tensor parallel costs a rank: its time inside the collectives, measured by torch's profiler.

torch's tensor parallel talks inside ``F`` and ``B``: as DTensor changes a tensor's layout (a row split's
partial sums made whole, a column split's input gradient summed) it calls torch's functional
collectives, ops of the ``c10d_functional`` namespace, each launched and then waited for where its result
is first used. Nothing else in a step takes that path: the pipeline's messages, the tie's and the
replicas' sums and FSDP2's gathers call ``torch.distributed`` directly. So the time of those ops on a
rank, launches and waits, overlapping calls counted once, is the time tensor parallel's collectives took
from it.

No public hook of torch sees those calls; its profiler (``torch.profiler``) does, but records every op
while it runs and builds an event per op when read, which costs (``docs/benchmarks.md``). So only chosen
steps are profiled (``train``: a few after the warm-up, left out of the run's other figures), and any
other step runs as if this module did not exist.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

NAMESPACE = "c10d_functional::"  # torch's functional collectives: "_c10d_functional::all_reduce", ...
NOT_LAUNCHES = ("wait_tensor", "_wrap_tensor_autograd")  # a launch's wait, and its autograd wrapper
QUIET = "6"  # a log level above kineto's highest: at its default it writes a line at each start and stop


@dataclass
class CollectiveTime:
    """One rank's functional collectives over a profiled stretch of code."""

    seconds: float = 0.0  # time inside them (launches and waits; overlapping calls counted once)
    calls: int = 0  # collectives launched (each one's wait is part of its time, not another call)


@contextmanager
def timing_collectives() -> Iterator[CollectiveTime]:
    """Profile the code inside; when it ends, the yielded record holds the time and number of the
    functional collectives it ran on this rank. A profiled stretch runs slower than an unprofiled one."""
    found = CollectiveTime()
    os.environ.setdefault("KINETO_LOG_LEVEL", QUIET)  # read when the profiler first starts; a user's is kept
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        yield found
    spans = []
    for event in profiler.events():
        if NAMESPACE in event.name:
            spans.append((event.time_range.start, event.time_range.end))
            found.calls += event.name.rsplit("::", 1)[-1] not in NOT_LAUNCHES
    found.seconds = covered_seconds(spans) / 1e6


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """The time that ``(start, end)`` spans cover, in their unit, overlaps counted once."""
    total, reached = 0, None
    for start, end in sorted(spans):
        begin = start if reached is None else max(start, reached)
        total += max(0, end - begin)
        reached = end if reached is None else max(reached, end)
    return total
