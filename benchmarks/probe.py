"""Measuring torch's stages the way pipeclock measures itself: compute spans and activation bytes.

torch's schedules call three methods of each ``PipelineStage`` per micro-batch: ``forward_one_chunk``,
``backward_one_chunk`` (whole, or only the input gradient in zero-bubble schedules) and
``backward_weight_one_chunk``. The schedule waits for its receives *before* calling them, so the time
inside them is compute (plus torch's own bookkeeping), which is what pipeclock's spans hold once their
receive wait is subtracted. Wrapping the three methods of the stage object gives the same ``Span`` record,
and so the same bubble arithmetic, without touching torch's code.

Time blocked on communication: torch's schedules wait for every batch of sends and receives through one
helper, ``schedules._wait_batch_p2p``; ``WaitClock`` times it (the counterpart of pipeclock's receive
waits plus its end-of-step send waits).

Activation memory uses pipeclock's own ``ActivationMeter`` around ``forward_one_chunk``: what autograd
saves, plus the stage's input and output (torch keeps both in its forward cache, as pipeclock stashes
both), held until the micro-batch's last backward piece on that stage.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from torch.distributed.pipelining import PipelineStage, schedules

from pipeclock.engine.actions import Action
from pipeclock.engine.memory import ActivationMeter
from pipeclock.observe.timeline import Span


class StageProbe:
    """Records spans for every stage of one rank, and (when ``metering``) their activation bytes."""

    def __init__(self, rank: int, stages: list[PipelineStage]):
        self.rank = rank
        self.spans: list[Span] = []
        self.metering = False
        self.meter = ActivationMeter([stage.submod for stage in stages])
        for chunk, stage in enumerate(stages):
            self._wrap(stage, chunk)

    def reset(self, metering: bool) -> None:
        """Start a step: no spans yet; meter activations only when asked (it costs a hook per save)."""
        self.spans = []
        self.metering = metering
        self.meter.reset()

    @property
    def peak_activation_bytes(self) -> int | None:
        return self.meter.peak if self.metering else None

    def _wrap(self, stage: PipelineStage, chunk: int) -> None:
        forward, backward, weight = (
            stage.forward_one_chunk,
            stage.backward_one_chunk,
            stage.backward_weight_one_chunk,
        )

        def forward_one_chunk(mb: int, *args, **kwargs):
            start = time.perf_counter()
            stashed: list = []
            with self.meter.measuring((mb, chunk), stashed) if self.metering else nullcontext():
                output = forward(mb, *args, **kwargs)
                outputs, inputs = stage.fwd_cache[mb]
                stashed.extend(t for t in (*outputs, *inputs) if hasattr(t, "untyped_storage"))
            if self.metering:
                self.meter.hold((mb, chunk))
            self._record("F", mb, chunk, start)
            return output

        def backward_one_chunk(mb: int, *args, full_backward: bool = True, **kwargs):
            start = time.perf_counter()
            result = backward(mb, *args, full_backward=full_backward, **kwargs)
            if full_backward:
                self._release(mb, chunk)
            self._record("B", mb, chunk, start)
            return result

        def backward_weight_one_chunk(mb: int, *args, **kwargs):
            start = time.perf_counter()
            result = weight(mb, *args, **kwargs)
            self._release(mb, chunk)
            self._record("W", mb, chunk, start)
            return result

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _release(self, mb: int, chunk: int) -> None:
        if self.metering:
            self.meter.release((mb, chunk))

    def _record(self, op: str, mb: int, chunk: int, start: float) -> None:
        self.spans.append(Span(self.rank, Action(op, mb, chunk), start, time.perf_counter()))  # type: ignore[arg-type]


class WaitClock:
    """Seconds spent inside torch's ``_wait_batch_p2p`` since the last ``reset`` (installed once)."""

    seconds = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        wait = schedules._wait_batch_p2p

        def timed_wait(work):
            start = time.perf_counter()
            try:
                return wait(work)
            finally:
                cls.seconds += time.perf_counter() - start

        schedules._wait_batch_p2p = timed_wait
        cls._installed = True

    @classmethod
    def reset(cls) -> None:
        cls.seconds = 0.0
