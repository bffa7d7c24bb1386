"""How a step times its actions: on a GPU with events read once the step is over, never a wait per action.

A CUDA event is recorded on the stream and read later; ``EventClock`` takes any event with that API. On
the CPU a stand-in records the host's clock when recorded and writes down every record and every read,
so the events path runs here, on real gloo ranks, and the test sees when the clock read its events.
"""

from __future__ import annotations

import itertools
import time
from typing import ClassVar

import torch

from pipeclock import schedule
from pipeclock.engine.action_clock import EventClock, HostClock, clock_for
from pipeclock.models.mlp import ShardedMLP
from tests.distributed import run_ok


class StandInEvent:
    """``torch.cuda.Event``'s API on the CPU: ``record`` notes the host's clock; every call is logged."""

    log: ClassVar[list[tuple[str, int]]] = []
    times: ClassVar[dict[int, float]] = {}
    made = itertools.count()

    def __init__(self) -> None:
        self.number = next(StandInEvent.made)

    def record(self) -> None:
        StandInEvent.times[self.number] = time.perf_counter()
        StandInEvent.log.append(("record", self.number))

    def synchronize(self) -> None:
        StandInEvent.log.append(("read", self.number))

    def elapsed_time(self, later: StandInEvent) -> float:
        StandInEvent.log.append(("read", later.number))
        return (StandInEvent.times[later.number] - StandInEvent.times[self.number]) * 1e3


def _timed_with_events(rank: int, world: int) -> dict:
    out = {}
    for name in ("1f1b", "zb-h1"):
        pipe = schedule.Pipeline(ShardedMLP(16, 8, rank, world), name, 4)
        pipe.new_clock = lambda: EventClock(StandInEvent)
        StandInEvent.log.clear()
        pipe.step(torch.randn(16, 16), torch.randn(16, 16))
        spans = pipe.last.spans
        log = list(StandInEvent.log)
        out[name] = ([str(a) for a in pipe.actions], spans, log, dict(StandInEvent.times))
    return out


def test_events_are_read_once_the_step_is_over_and_give_each_action_its_span():
    for rank, results in enumerate(run_ok(_timed_with_events, 2)):
        for name, (actions, spans, log, times) in results.items():
            records = [number for what, number in log if what == "record"]
            first_read = next(index for index, (what, _) in enumerate(log) if what == "read")
            assert all(what == "read" for what, _ in log[first_read:]), (name, "an event read mid-step")
            assert len(records) >= 1 + 2 * len(actions), "an origin, and a start and an end per action"
            assert [str(s.action) for s in spans] == actions, name
            assert all(s.rank == rank and 0 <= s.wait <= s.duration for s in spans), name
            assert all(a.end <= b.start for a, b in itertools.pairwise(spans)), name
            # the first action's start to the last one's end: those two events' distance on the stand-in's
            # clock, placed on the host's time line (before now)
            total = times[records[-1]] - times[records[1]]
            assert abs((spans[-1].end - spans[0].start) - total) < 1e-9, name
            assert spans[0].duration > 0 and spans[-1].end <= time.perf_counter()


def test_the_host_clock_times_a_cpu_and_events_time_a_gpu():
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    clock = HostClock()
    first, second = clock.mark(), clock.mark()
    assert clock.seconds([first, second]) == [first, second] and first <= second
