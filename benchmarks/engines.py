"""The two engines behind one ``step``, each on its own copy of the same stage modules of one rank.

Each engine runs as a user would run it: pipeclock's ``Pipeline`` with its defaults (it meters activations
on every step), torch's schedule with a mean-reduced loss and ``scale_grads`` (its default, which gives
the batch-mean gradient pipeclock gives) and ``return_outputs=False`` (pipeclock returns no outputs either,
so neither does work the other skips). torch's stages carry only the span timers of ``probe`` while timed;
their activations are metered on the checked step.

Each engine gets its own ``ShardedMLP`` chunks, built from the same seed, so the weights are equal bit
for bit. Sharing one set of modules would let one engine's module hooks (pipeclock's zero-bubble schedule
hooks every Linear to split the backward) run inside the other engine's forwards.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining

from benchmarks import load, rss
from benchmarks.plan import Case
from benchmarks.probe import StageProbe, WaitClock
from pipeclock import comms, schedule
from pipeclock.engine.placement import Placement
from pipeclock.model import ShardedMLP
from pipeclock.observe.timeline import Span


@dataclass
class StepSample:
    """One step of one engine on one rank (picklable: gathered to rank 0)."""

    start: float
    end: float
    cpu_s: float  # CPU time of this process (all its threads) during the step
    wait_s: float  # time blocked on point-to-point communication
    loss: float | None  # the batch loss where this rank knows it
    spans: list[Span]
    peak_activation_bytes: int | None
    peak_rss_bytes: int  # the process's peak resident memory during the step
    start_rss_bytes: int  # and its resident memory when the step began
    machine_busy_s: float | None  # CPU time the whole machine was busy during the step (all processes)


class _Clock:
    """Wall and CPU time of one step, and the window of the RSS high-water mark."""

    def __enter__(self) -> _Clock:
        rss.reset_peak()
        self.start_rss = rss.current_bytes()
        self.busy = load.busy_seconds()
        self.cpu, self.start = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.end, self.cpu = time.perf_counter(), time.process_time() - self.cpu
        busy = load.busy_seconds()
        self.busy = busy - self.busy if busy is not None and self.busy is not None else None
        self.peak_rss = rss.peak_bytes()


class PipeclockEngine:
    """``schedule.Pipeline`` as it ships; its end-of-step send waits are timed from outside."""

    def __init__(self, case: Case, measure_memory: bool = True):
        self.modules = stage_modules(case)
        self.name = "pipeclock" if measure_memory else "pipeclock-unmetered"
        self.pipe = schedule.Pipeline(
            self.modules, case.schedule, case.microbatches, F.mse_loss, measure_memory=measure_memory
        )
        self.send_wait = 0.0
        finish = self.pipe.messenger.finish

        def timed_finish() -> None:
            start = time.perf_counter()
            try:
                finish()
            finally:
                self.send_wait += time.perf_counter() - start

        self.pipe.messenger.finish = timed_finish

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, metering: bool) -> StepSample:
        """One training step (``metering`` is ignored: pipeclock always meters, as it ships)."""
        self.send_wait = 0.0
        with _Clock() as clock:
            loss = self.pipe.step(inputs, targets)
        record = self.pipe.last
        waited = self.send_wait + sum(span.wait for span in record.spans)
        return StepSample(
            clock.start,
            clock.end,
            clock.cpu,
            waited,
            loss,
            record.spans,
            record.peak_activation_bytes,
            clock.peak_rss,
            clock.start_rss,
            clock.busy,
        )


class TorchEngine:
    """A ``torch.distributed.pipelining`` schedule over ``PipelineStage``s of the same modules."""

    name = "torch"

    def __init__(self, case: Case):
        rank, world = comms.get_rank(), comms.get_world_size()
        self.modules = stage_modules(case)
        placement = Placement.named(case.placement, world, case.chunks)
        stages = [
            pipelining.PipelineStage(
                module, placement.stage(rank, chunk), placement.num_virtual, comms.device()
            )
            for chunk, module in enumerate(self.modules)
        ]
        self.probe = StageProbe(rank, stages)
        WaitClock.install()
        self.is_first = any(stage.is_first for stage in stages)
        self.is_last = any(stage.is_last for stage in stages)
        kind = getattr(pipelining, case.torch_schedule)
        multi = issubclass(kind, pipelining.schedules.PipelineScheduleMulti)
        self.schedule = kind(stages if multi else stages[0], case.microbatches, loss_fn=F.mse_loss)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, metering: bool) -> StepSample:
        """One training step; ``metering`` turns on the activation meter for this step."""
        self.probe.reset(metering)
        WaitClock.reset()
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        args = (inputs,) if self.is_first else ()
        target = targets if self.is_last else None
        with _Clock() as clock:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        loss = statistics.fmean(float(x.detach()) for x in losses) if losses else None
        return StepSample(
            clock.start,
            clock.end,
            clock.cpu,
            WaitClock.seconds,
            loss,
            self.probe.spans,
            self.probe.peak_activation_bytes,
            clock.peak_rss,
            clock.start_rss,
            clock.busy,
        )


def stage_modules(case: Case) -> list[nn.Module]:
    """This rank's chunks of the case's model: the same weights for every engine (same seed)."""
    rank, world = comms.get_rank(), comms.get_world_size()
    return ShardedMLP.for_rank(
        case.hidden, case.layers, rank, world, case.chunks, seed=0, placement=case.placement
    )


def build(case: Case, with_unmetered: bool = False) -> list:
    """pipeclock's engine, torch's (when torch accepts the configuration), and maybe pipeclock unmetered."""
    built: list[PipeclockEngine | TorchEngine] = [PipeclockEngine(case)]
    if case.torch_schedule is not None:
        built.append(TorchEngine(case))
    if with_unmetered:
        built.append(PipeclockEngine(case, measure_memory=False))
    return built
