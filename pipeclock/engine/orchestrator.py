"""The clock-cycle loop: one rank runs its list of actions, whatever the schedule.

``Pipeline.step`` cuts the batch into micro-batches, then walks this rank's actions in order. Each
action is one "tick": ``F`` runs a micro-batch forward through one local chunk, ``B`` runs it backward
(or only its input-gradient half), ``W`` finishes the weight gradients. What to receive before a tick and
what to send after it follows from the action alone (``pipeclock.engine.messenger``); the loop never
asks which schedule it is running.

The math is the one-device math: each micro-batch's mean loss is weighted by its share of the batch, so
after a step every ``.grad`` holds what the whole model on one process computes for the whole batch.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pipeclock import comms
from pipeclock.engine.actions import Action, is_split, validate, virtual_stage
from pipeclock.engine.backward import (
    ParameterOutputs,
    backward_input,
    backward_weight,
    backward_whole,
    held_tensors,
    modified_in_place,
)
from pipeclock.engine.generators import Generator, generate
from pipeclock.engine.memory import ActivationMeter
from pipeclock.engine.messenger import MAX_MICROBATCHES, Messenger
from pipeclock.engine.microbatch import loss_weights, microbatch_sizes
from pipeclock.observe.simulate import simulate
from pipeclock.observe.timeline import Span

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageError(RuntimeError):
    """A stage's own computation failed (a shape that does not fit, a bad loss ...); names rank and action."""


@dataclass
class StepRecord:
    """What one step did on this rank: its loss, duration, spans and measured activation peak."""

    loss: float
    seconds: float
    spans: list[Span]
    peak_activation_bytes: int | None


@dataclass
class _Stash:
    """What a micro-batch's forward leaves for its backward on one chunk."""

    stage_input: torch.Tensor
    root: torch.Tensor | None  # the chunk's output, or the weighted loss on the last stage
    captured: list = field(default_factory=list)
    weight_work: list = field(default_factory=list)


class Pipeline:
    """Runs one rank's share of a pipeline-parallel training step.

    ``stage_or_chunks`` is this rank's module, or a list of modules (one per chunk) for interleaved
    schedules. ``schedule`` is a name from ``schedule.SCHEDULES`` or a generator function.
    """

    def __init__(
        self,
        stage_or_chunks: nn.Module | Sequence[nn.Module],
        schedule: str | Generator = "1f1b",
        num_microbatches: int = 8,
        loss_fn: LossFn = F.mse_loss,
        *,
        measure_memory: bool = True,
    ):
        self.rank, self.num_stages = comms.get_rank(), comms.get_world_size()
        self.chunks = _as_chunks(stage_or_chunks)
        self.schedule_name = (
            schedule if isinstance(schedule, str) else getattr(schedule, "__name__", "custom")
        )
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.table = self._build_schedule(schedule)  # every rank's actions
        self.actions = self.table[self.rank]
        self.split = is_split(self.table)  # backward split into B and W
        self.num_virtual = self.num_stages * len(self.chunks)
        self.messenger = Messenger(self.rank, self.num_stages, self.num_virtual)
        self.meter = ActivationMeter(self.chunks) if measure_memory else None
        self.parameter_outputs = ParameterOutputs(self.chunks)
        self.copies_input = [_starts_in_place(chunk) for chunk in self.chunks]
        self.device = comms.device()
        self.last: StepRecord | None = None

    def _build_schedule(self, schedule: str | Generator) -> list[list[Action]]:
        """Every rank's actions; every check here sees the same inputs on every rank, so all raise alike."""
        m = self.num_microbatches
        if not isinstance(m, int) or not 1 <= m < MAX_MICROBATCHES:
            limit = MAX_MICROBATCHES - 1
            raise ValueError(
                f"rank {self.rank}: num_microbatches must be an integer in 1..{limit}, got {m!r}"
            )
        try:
            table = generate(schedule, self.num_stages, m, len(self.chunks))
            validate(table, self.num_stages, m, len(self.chunks))
        except ValueError as error:
            raise ValueError(f"rank {self.rank}: {error}") from None
        if not isinstance(schedule, str):
            simulate(table)  # a custom generator's schedule must be able to finish: DeadlockError if not
        return table

    # --- one training step -----------------------------------------------------------------------------

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> float:
        """Forward and backward over the batch; returns the batch's mean loss (a float) on every rank.

        ``inputs`` are read on the first stage and ``targets`` on the last; other ranks may pass None.
        Gradients accumulate into ``.grad`` as after ``loss.backward()``: zeroing them and the optimizer
        step stay the caller's.
        """
        start = time.perf_counter()
        sizes = self._agree_on_batch(inputs, targets)
        run = _StepRun(self, sizes, inputs, targets)
        run.prefetch(0)
        for index, action in enumerate(self.actions):
            run.prefetch(index + 1)  # receives are posted in action order, one tick ahead
            run.execute(action)
        self.messenger.finish()
        loss = self._share_loss(run.loss)
        peak = self.meter.peak if self.meter else None
        self.last = StepRecord(loss, time.perf_counter() - start, run.spans, peak)
        return loss

    def _agree_on_batch(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> list[int]:
        """Share the batch size and check that every rank runs the same configuration.

        Only the first stage sees the inputs and only the last the targets, so one small all-gather lets
        every rank raise the same clear error for a bad batch, before any pipeline message is sent.
        """
        first, last = self.rank == 0, self.rank == self.num_stages - 1
        mine = torch.tensor(
            [
                self.num_microbatches,
                len(self.chunks),
                zlib.crc32(self.schedule_name.encode()),
                _batch_size(inputs) if first else -2,
                _batch_size(targets) if last else -2,
            ],
            dtype=torch.int64,
            device=self.device,
        )
        rows = (
            [mine] if self.num_stages == 1 else comms.all_gather(mine, "agreeing on the batch and schedule")
        )
        rows = [row.tolist() for row in rows]
        if any(row[:3] != rows[0][:3] for row in rows):
            described = "; ".join(f"rank {r}: m={row[0]}, chunks={row[1]}" for r, row in enumerate(rows))
            raise ValueError(
                f"rank {self.rank}: ranks disagree on micro-batches, chunks or schedule ({described})"
            )
        batch, target_batch = rows[0][3], rows[-1][4]
        if batch < 0:
            raise ValueError(f"rank {self.rank}: the first stage (rank 0) was given no inputs tensor")
        if target_batch < 0:
            raise ValueError(
                f"rank {self.rank}: the last stage (rank {self.num_stages - 1}) was given no targets"
            )
        if batch != target_batch:
            raise ValueError(f"rank {self.rank}: {batch} inputs but {target_batch} targets in the batch")
        try:
            return microbatch_sizes(batch, self.num_microbatches)
        except ValueError as error:
            raise ValueError(f"rank {self.rank}: {error}") from None

    def _share_loss(self, loss: torch.Tensor | None) -> float:
        if self.num_stages == 1:
            return float(loss)
        value = torch.zeros((), dtype=torch.float64, device=self.device) if loss is None else loss.double()
        return float(comms.broadcast(value, self.num_stages - 1, "sharing the loss"))


class _StepRun:
    """The state of one step on one rank: micro-batches, stashes, the loss and the spans."""

    def __init__(self, pipe: Pipeline, sizes: list[int], inputs, targets):
        self.pipe, self.sizes, self.weights = pipe, sizes, loss_weights(sizes)
        self.inputs = _split(inputs, sizes, pipe.device) if pipe.rank == 0 else None
        self.targets = _split(targets, sizes, pipe.device) if pipe.rank == pipe.num_stages - 1 else None
        self.stash: dict[tuple[int, int], _Stash] = {}
        self.loss: torch.Tensor | None = None
        self.spans: list[Span] = []
        if pipe.meter:
            pipe.meter.reset()

    def _stage(self, action: Action) -> int:
        return virtual_stage(self.pipe.rank, action.chunk, self.pipe.num_stages)

    def prefetch(self, index: int) -> None:
        """Post the receive that action ``index`` will need, so its data arrives during this tick."""
        if index >= len(self.pipe.actions):
            return
        action = self.pipe.actions[index]
        stage, mb = self._stage(action), action.microbatch
        if action.op == "F" and stage > 0:
            self.pipe.messenger.expect_activation(stage, mb, self.sizes[mb])
        elif action.op == "B" and stage < self.pipe.num_virtual - 1 and (mb, action.chunk) in self.stash:
            self.pipe.messenger.expect_gradient(stage, mb, self.stash[(mb, action.chunk)].root)

    def execute(self, action: Action) -> None:
        messenger = self.pipe.messenger
        messenger.wait_seconds = 0.0
        start = time.perf_counter()
        try:
            {"F": self.forward, "B": self.backward, "W": self.weight}[action.op](action)
        except comms.CommError:
            raise
        except Exception as error:
            stage = self._stage(action)
            raise StageError(
                f"rank {self.pipe.rank}: {action} (virtual stage {stage}) failed: {error}"
            ) from error
        if self.pipe.device.type == "cuda":
            torch.cuda.synchronize(self.pipe.device)  # CUDA runs asynchronously: time kernels, not launches
        self.spans.append(Span(self.pipe.rank, action, start, time.perf_counter(), messenger.wait_seconds))

    def forward(self, action: Action) -> None:
        pipe, stage, mb = self.pipe, self._stage(action), action.microbatch
        if stage == 0:
            stage_input = self.inputs[mb]
        else:
            stage_input = pipe.messenger.receive_activation(stage, mb, self.sizes[mb]).requires_grad_()
        meter, captures = pipe.meter, pipe.parameter_outputs
        stashed = [stage_input]
        with meter.measuring((mb, action.chunk), stashed) if meter else nullcontext():
            with captures.capture() as captured:
                fed = stage_input.clone() if pipe.copies_input[action.chunk] else stage_input
                output = pipe.chunks[action.chunk](fed)
            stashed.append(output)
        if stage == pipe.num_virtual - 1:
            root = pipe.loss_fn(output, self.targets[mb]) * self.weights[mb]
            self.loss = root.detach() if self.loss is None else self.loss + root.detach()
        else:
            root = output
            pipe.messenger.send_activation(stage, mb, self.sizes[mb], output)
        self.stash[(mb, action.chunk)] = _Stash(stage_input, root, captured)
        if meter:
            meter.hold((mb, action.chunk))

    def backward(self, action: Action) -> None:
        pipe, stage, mb = self.pipe, self._stage(action), action.microbatch
        key = (mb, action.chunk)
        stash = self.stash[key]
        grad = (
            None if stage == pipe.num_virtual - 1 else pipe.messenger.receive_gradient(stage, mb, stash.root)
        )
        if not pipe.split and modified_in_place(stash.captured):
            input_grad = backward_whole(stash.root, grad, stash.stage_input)  # plain autograd, same result
            self._done(*key)
        else:
            keep_graph = pipe.parameter_outputs.keeps_graph
            input_grad, work = backward_input(stash.root, grad, stash.stage_input, stash.captured, keep_graph)
            if pipe.split:  # W comes later: hold only what it needs
                self.stash[key] = _Stash(stash.stage_input, stash.root if keep_graph else None, [], work)
                if pipe.meter:
                    pipe.meter.update(key, held_tensors(work), keep_graph)
            else:
                backward_weight(work)
                self._done(*key)
        if stage > 0:
            pipe.messenger.send_gradient(stage, mb, input_grad)

    def weight(self, action: Action) -> None:
        backward_weight(self.stash[(action.microbatch, action.chunk)].weight_work)
        self._done(action.microbatch, action.chunk)

    def _done(self, mb: int, chunk: int) -> None:
        del self.stash[(mb, chunk)]
        if self.pipe.meter:
            self.pipe.meter.release((mb, chunk))


def _as_chunks(stage_or_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(stage_or_chunks, nn.Module) and not isinstance(stage_or_chunks, nn.ModuleList):
        return [stage_or_chunks]
    chunks = list(stage_or_chunks)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise ValueError(f"rank {comms.get_rank()}: expected an nn.Module or a non-empty list of them")
    return chunks


def _starts_in_place(module: nn.Module) -> bool:
    """True for a Sequential whose first layer works in place (``ReLU(inplace=True)`` right after a cut).

    The received activation is a leaf that autograd must not see modified, so such a chunk is fed a copy.
    """
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))


def _batch_size(tensor: torch.Tensor | None) -> int:
    return -1 if tensor is None else (tensor.shape[0] if tensor.dim() else 0)


def _split(batch: torch.Tensor, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    return list(torch.split(batch.to(device), sizes))
