"""When each action of a step ran: the host's clock on a CPU, CUDA events on a GPU, read after the step.

On a CPU an action's work is done when its call returns, so ``time.perf_counter`` before and after it is
its span. On a GPU the call returns once its kernels are queued: reading the host clock then times the
launches, and synchronizing the device after each action to time the kernels stops the CPU from queuing
the next action's work meanwhile (the GPU idles between actions). So there each mark is a CUDA event
recorded on the stream, in the stream's order with the kernels, and the events are read only once the
step is over (its loss, a number on the host, waited for the device anyway). A receive's wait is a pair
of marks too: on the GPU, what the stream spent waiting for the message.

A clock's times are seconds on ``time.perf_counter``'s scale, so the spans of ranks on one machine share a
time line: an event clock places its events after an origin event recorded at the step's start, when
the device is idle (the previous step's loss was waited for).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeclock.engine.actions import Action
from pipeclock.engine.spans import Span

Stamp = Any  # what ``mark`` returns: a float (the host clock) or a recorded event


class HostClock:
    """``time.perf_counter`` at each mark: exact where a call returns once its work is done (a CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, stamps: Sequence[float]) -> list[float]:
        return list(stamps)


class EventClock:
    """A CUDA event recorded at each mark, on the current stream; read once, after the step (``seconds``).

    ``new_event`` makes an event with ``record()``, ``synchronize()`` and ``elapsed_time(later)`` (in ms):
    ``torch.cuda.Event(enable_timing=True)`` by default.
    """

    def __init__(self, new_event: Callable[[], Any] | None = None) -> None:
        self.new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.origin_seconds = time.perf_counter()
        self.origin = self.mark()

    def mark(self) -> Any:
        event = self.new_event()
        event.record()
        return event

    def seconds(self, stamps: Sequence[Any]) -> list[float]:
        """Each stamp's time: waits (once) for the last of them, then reads them all."""
        if stamps:
            stamps[-1].synchronize()
        return [self.origin_seconds + self.origin.elapsed_time(stamp) / 1e3 for stamp in stamps]


def clock_for(device: torch.device) -> HostClock | EventClock:
    """The clock that times actions on ``device``: CUDA events on a GPU, else the host's clock."""
    return EventClock() if device.type == "cuda" else HostClock()


@dataclass
class Marked:
    """An action as marked while the step ran: its start and end, and its receives' waits."""

    action: Action
    start: Stamp
    end: Stamp
    waits: list[tuple[Stamp, Stamp]]


def spans_of(clock: HostClock | EventClock, rank: int, marked: Sequence[Marked]) -> list[Span]:
    """The step's spans, its marks read all at once (after the step, on a GPU)."""
    stamps = [s for m in marked for s in (m.start, *(t for pair in m.waits for t in pair), m.end)]
    times = iter(clock.seconds(stamps))
    spans = []
    for m in marked:
        start = next(times)
        waited = 0.0
        for _ in m.waits:
            began = next(times)
            waited += next(times) - began
        spans.append(Span(rank, m.action, start, next(times), waited))
    return spans
