"""The clock-cycle loop: one rank runs its list of actions, whatever the schedule.

``Pipeline.step`` cuts the batch into micro-batches, then walks this rank's actions in order. Each
action is one "tick": ``F`` runs a micro-batch forward through one local chunk, ``B`` runs it backward
(or only its input-gradient half), ``W`` finishes the weight gradients. What to receive before a tick and
what to send after it follows from the action alone (``pipeclock.engine.messenger``); the loop never
asks which schedule it is running.

The math is the one-device math: each micro-batch's loss is weighted by its share of what the batch's
loss averages over (samples, or counted tokens: ``pipeclock.engine.losses``), dropout masks are keyed by
sample rather than drawn (``pipeclock.engine.rng``), and tied weights get their copies' gradients
summed (``pipeclock.engine.ties``), so after a step every ``.grad`` holds what the whole model on one
process computes for the whole batch.

``evaluate`` runs the same forwards without building any graph: the validation loss, on every rank.
"""

from __future__ import annotations

import time
import warnings
import zlib
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeclock import comms
from pipeclock.engine import pytree, rng
from pipeclock.engine.actions import Action, Schedule, placement_of, validate
from pipeclock.engine.backward import (
    ParameterOutputs,
    backward_input,
    backward_weight,
    backward_whole,
    gradient_roots,
    held_tensors,
    modified_in_place,
    rebuilds_beyond_linears,
)
from pipeclock.engine.generators import Generator, generate
from pipeclock.engine.losses import LossFn, loss_scales
from pipeclock.engine.memory import ActivationMeter
from pipeclock.engine.messenger import MAX_MICROBATCHES, Messenger
from pipeclock.engine.microbatch import microbatch_sizes
from pipeclock.engine.precision import Precision, parse_precision
from pipeclock.engine.recompute import RecomputePolicy, apply_recompute
from pipeclock.engine.replicas import Replicas, SinglePipeline
from pipeclock.engine.ties import TiedGradients
from pipeclock.observe.simulate import simulate
from pipeclock.observe.timeline import Span


class StageError(RuntimeError):
    """A stage's own computation failed (a shape that does not fit, a bad loss ...); names rank and action."""


@dataclass
class StepRecord:
    """What one step did on this rank: its loss, duration, spans and measured activation peak."""

    loss: float
    seconds: float
    spans: list[Span]
    peak_activation_bytes: int | None
    syncs: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each dp gradient sum
    sent_bytes: int = 0  # activations and gradients this rank sent to its pipeline neighbours

    @property
    def sync_seconds(self) -> float:
        """Time during which gradients were being summed across replicas (overlapping sums once)."""
        total, reached = 0.0, float("-inf")
        for start, end in sorted(self.syncs):
            total += max(0.0, end - max(start, reached))
            reached = max(reached, end)
        return total


@dataclass
class _Stash:
    """What a micro-batch's forward leaves for its backward on one chunk."""

    stage_input: object  # the received pytree (or the micro-batch's inputs on the first stage)
    output: object | None  # the chunk's output pytree
    root: torch.Tensor | None  # the weighted loss, on the last stage
    captured: list = field(default_factory=list)
    weight_work: list = field(default_factory=list)


class Pipeline:
    """Runs one rank's share of a pipeline-parallel training step.

    ``stage_or_chunks`` is this rank's module, or a list of modules (one per chunk) for interleaved
    schedules. ``schedule`` is a name from ``schedule.SCHEDULES`` or a generator function.

    ``loss_fn(output, targets)`` returns the mean loss over a micro-batch's samples; or, when it has a
    ``count(targets)`` method (``TokenCrossEntropy``), the *sum* over what ``count`` counts, and the
    step divides by the batch's total count (a token mean exact under uneven padding). Stages may hand
    each other any pytree of tensors. Parameters marked with ``tie`` have their copies' gradients summed.

    ``group`` is the process group of this pipeline's ranks (the ``"pp"`` dim of a mesh; default: the
    whole world): stage indices are ranks in that group. ``replicas`` (from ``pipeclock.parallel``) are
    the data-parallel copies of this pipeline: the batch given to ``step`` is then this replica's shard
    of the global batch, and the returned loss is the global batch's.

    ``recompute`` (``"none"``, ``"full"``, ``"every-K"``: ``pipeclock.engine.recompute``) checkpoints the
    chunks' blocks, in place: the same math with less activation memory. ``dtype="bf16"`` runs the
    forwards under autocast with float32 weights and gradients, and sends bf16 messages
    (``pipeclock.engine.precision``).
    """

    def __init__(
        self,
        stage_or_chunks: nn.Module | Sequence[nn.Module],
        schedule: str | Generator | Schedule = "1f1b",
        num_microbatches: int | None = None,
        loss_fn: LossFn = F.mse_loss,
        *,
        measure_memory: bool = True,
        group: dist.ProcessGroup | None = None,
        replicas: Replicas | None = None,
        recompute: str | RecomputePolicy | None = None,
        dtype: str | Precision | None = None,
    ):
        self.group = group
        self.peers = _group_ranks(group)  # global rank of each pipeline rank
        self.global_rank = comms.get_rank()
        self.rank, self.num_stages = self.peers.index(self.global_rank), len(self.peers)
        self.replicas = replicas or SinglePipeline()
        self.chunks = _as_chunks(stage_or_chunks)
        self.schedule_name = (
            schedule
            if isinstance(schedule, str)
            else getattr(schedule, "__name__", "csv" if isinstance(schedule, list) else "custom")
        )
        self.table = self._build_schedule(schedule, num_microbatches)  # every rank's actions
        self.num_microbatches = 1 + max(a.microbatch for row in self.table for a in row)
        self._fingerprint = zlib.crc32(repr((self.table, self.placement.stages)).encode())
        self.loss_fn = loss_fn
        self.actions = self.table[self.rank]
        # evaluation: every forward in (micro-batch, stage) order, an order every rank agrees on
        self.forward_actions = sorted((a for a in self.actions if a.op == "F"), key=self._forward_order)
        self.num_virtual = self.placement.num_virtual
        self.first_rank = self.placement.owner(0)[0]
        self.last_rank = self.placement.owner(self.num_virtual - 1)[0]
        self.precision = parse_precision(dtype)
        self.messenger = Messenger(self.rank, self.placement, self.peers, self.precision.wire_dtype)
        self.meter = ActivationMeter(self.chunks) if measure_memory else None
        recomputed = apply_recompute(self.chunks, recompute)
        self.parameter_outputs = ParameterOutputs(self.chunks, recomputed)
        self.copies_input = [_starts_in_place(chunk) for chunk in self.chunks]
        self.device = comms.device()
        self.ties = TiedGradients(self.chunks, group)
        self.last_backward = self._last_backward_actions()
        _warn_about_batch_norm(self.global_rank, self.chunks)
        self.steps_done = 0  # keys dropout masks by step; set it when resuming a run
        self.first_sample = 0  # this replica's shard's place in the global batch
        self.last: StepRecord | None = None

    def _build_schedule(self, schedule, m: int | None) -> list[list[Action]]:
        """Every rank's actions; every check here sees the same inputs on every rank, so all raise alike.

        A ready table (a ``Schedule``, e.g. from ``load_csv``) brings its own micro-batch count: ``m``, if
        given, must agree with it.
        """
        if isinstance(schedule, list):
            table_m = 1 + max((a.microbatch for row in schedule for a in row), default=-1)
            if m is not None and m != table_m:
                raise ValueError(
                    f"rank {self.global_rank}: the schedule has {table_m} micro-batches, not {m}"
                )
            m = table_m
        m = 8 if m is None else m
        if not isinstance(m, int) or not 1 <= m < MAX_MICROBATCHES:
            limit = MAX_MICROBATCHES - 1
            raise ValueError(
                f"rank {self.global_rank}: num_microbatches must be an integer in 1..{limit}, got {m!r}"
            )
        try:
            table = (
                schedule
                if isinstance(schedule, list)
                else generate(schedule, self.num_stages, m, len(self.chunks))
            )
            self.placement = placement_of(table)
            self._check_placement(table)
            validate(table, self.num_stages, m, len(self.chunks))
        except ValueError as error:
            raise ValueError(f"rank {self.global_rank}: {error}") from None
        if not isinstance(schedule, str):
            simulate(table)  # a custom schedule must be able to finish: DeadlockError if not
        return table

    def _check_placement(self, table: list[list[Action]]) -> None:
        held = len(self.placement.stages[self.rank]) if self.rank < self.placement.num_ranks else 0
        if self.placement.num_ranks != self.num_stages:
            raise ValueError(f"the schedule is for {self.placement.num_ranks} ranks, not {self.num_stages}")
        if held != len(self.chunks):
            stages = ", ".join(map(str, self.placement.stages[self.rank]))
            raise ValueError(
                f"the schedule gives this rank {held} chunk(s) (virtual stages {stages}), "
                f"but {len(self.chunks)} module(s) were given"
            )

    def _last_backward_actions(self) -> dict[int, int]:
        """For each chunk, the index of the action after which its gradients are complete for the step."""
        weights = "BW" if self.replicas.split_backward else "BI"
        return {a.chunk: i for i, a in enumerate(self.actions) if a.op in weights}

    def _forward_order(self, action: Action) -> tuple[int, int]:
        """Evaluation runs each micro-batch through the stages in pipeline order, on every rank alike."""
        return action.microbatch, self.placement.stage(self.rank, action.chunk)

    # --- one training step -----------------------------------------------------------------------------

    def step(self, inputs=None, targets=None) -> float:
        """Forward and backward over the batch; returns the batch's mean loss (a float) on every rank.

        ``inputs`` (a tensor or pytree) are read on the first stage and ``targets`` on the last; other
        ranks may pass None. Gradients accumulate into ``.grad`` as after ``loss.backward()``: zeroing
        them and the optimizer step stay the caller's.
        """
        start = time.perf_counter()
        sizes = self._agree_on_batch(inputs, targets)
        self.ties.prepare()
        self.replicas.begin_step()
        run = _StepRun(self, sizes, inputs, targets)
        with self.precision.step_region(self.device):
            run.run()
        self.ties.sync()
        loss = self._share_loss(run.loss)
        peak = self.meter.peak if self.meter else None
        self.last = StepRecord(loss, time.perf_counter() - start, run.spans, peak, run.syncs, run.sent_bytes)
        self.steps_done += 1
        return loss

    def evaluate(self, inputs=None, targets=None) -> float:
        """The batch's mean loss, forward only: no graph built, no activation held, dropout off.

        Every rank calls it together, like ``step``; the modules are in ``eval()`` mode meanwhile and
        return to their own mode after.
        """
        sizes = self._agree_on_batch(inputs, targets)
        self.ties.prepare()
        modes = [chunk.training for chunk in self.chunks]
        run = _StepRun(self, sizes, inputs, targets, training=False)
        try:
            for chunk in self.chunks:
                chunk.eval()
            with torch.no_grad(), self.precision.step_region(self.device):
                run.run()
        finally:
            for chunk, mode in zip(self.chunks, modes, strict=True):
                chunk.train(mode)
            self.replicas.end_evaluation()
        return self._share_loss(run.loss)

    def _agree_on_batch(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> list[int]:
        """Share the batch size and check that every rank runs the same configuration.

        Only the first stage sees the inputs and only the last the targets, so one small all-gather lets
        every rank raise the same clear error for a bad batch, before any pipeline message is sent.
        """
        first, last = self.rank == self.first_rank, self.rank == self.last_rank
        mine = torch.tensor(
            [
                self.num_microbatches,
                len(self.chunks),
                self._fingerprint,
                _batch_size(inputs, "the inputs") if first else -2,
                _batch_size(targets, "the targets") if last else -2,
            ],
            dtype=torch.int64,
            device=self.device,
        )
        rows = (
            [mine]
            if self.num_stages == 1
            else comms.all_gather(mine, "agreeing on the batch and schedule", self.group)
        )
        rows = [row.tolist() for row in rows]
        if any(row[:3] != rows[0][:3] for row in rows):
            described = "; ".join(
                f"rank {self.peers[r]}: m={row[0]}, chunks={row[1]}" for r, row in enumerate(rows)
            )
            raise ValueError(
                f"rank {self.global_rank}: ranks disagree on micro-batches, chunks or schedule ({described})"
            )
        batch, target_batch = rows[self.first_rank][3], rows[self.last_rank][4]
        if batch < 0:
            raise ValueError(
                f"rank {self.global_rank}: the first stage (rank {self.peers[self.first_rank]}) "
                "was given no inputs tensor"
            )
        if target_batch < 0:
            raise ValueError(
                f"rank {self.global_rank}: the last stage (rank {self.peers[self.last_rank]}) "
                "was given no targets"
            )
        if batch != target_batch:
            raise ValueError(
                f"rank {self.global_rank}: {batch} inputs but {target_batch} targets in the batch"
            )
        try:
            sizes = microbatch_sizes(batch, self.num_microbatches)
        except ValueError as error:
            raise ValueError(f"rank {self.global_rank}: {error}") from None
        self.first_sample = self.replicas.first_sample(batch)
        return sizes

    def _share_loss(self, loss: torch.Tensor | None) -> float:
        """The global batch's loss on every rank: summed over the replicas, sent from the last stage."""
        value = torch.zeros((), dtype=torch.float64, device=self.device) if loss is None else loss.double()
        if self.rank == self.last_rank:
            value = self.replicas.total(value, "summing the replicas' losses")
        if self.num_stages > 1:
            last = self.peers[self.last_rank]
            value = comms.broadcast(value, last, "sharing the loss", self.group)
        return float(value)

    def global_total(self, local: int) -> int:
        """A count (samples or tokens) summed over the data-parallel replicas' shards of the batch."""
        value = torch.tensor(local, dtype=torch.int64, device=self.device)
        return int(self.replicas.total(value, "adding up the global batch"))


class _StepRun:
    """The state of one step (or one evaluation) on one rank: micro-batches, stashes, loss and spans."""

    def __init__(self, pipe: Pipeline, sizes: list[int], inputs, targets, training: bool = True):
        self.pipe, self.sizes, self.training = pipe, sizes, training
        self.actions = pipe.actions if training else pipe.forward_actions
        self.first_samples = [pipe.first_sample + sum(sizes[:mb]) for mb in range(len(sizes))]
        self.inputs = pytree.split(inputs, sizes, pipe.device) if pipe.rank == pipe.first_rank else None
        self.targets = None
        if pipe.rank == pipe.last_rank:
            self.targets = pytree.split(targets, sizes, pipe.device)
            self.scales = loss_scales(pipe.loss_fn, self.targets, sizes, pipe.global_total)
        self.stash: dict[tuple[int, int], _Stash] = {}
        self.loss: torch.Tensor | None = None
        self.spans: list[Span] = []
        self.syncs: list[tuple[float, float]] = []
        self.meter = pipe.meter
        if self.meter:
            self.meter.reset()

    def _stage(self, action: Action) -> int:
        return self.pipe.placement.stage(self.pipe.rank, action.chunk)

    def prefetch(self, index: int) -> None:
        """Post the receive that action ``index`` will need, so its data arrives during this tick."""
        if index >= len(self.actions):
            return
        action = self.actions[index]
        stage, mb = self._stage(action), action.microbatch
        if action.op == "F" and stage > 0:
            self.pipe.messenger.expect_activation(stage, mb, self.sizes[mb])
        elif action.op in "BI" and stage < self.pipe.num_virtual - 1 and (mb, action.chunk) in self.stash:
            self.pipe.messenger.expect_gradient(stage, mb, self.stash[(mb, action.chunk)].output)

    def run(self) -> None:
        self.pipe.messenger.sent_bytes = 0
        self.prefetch(0)
        for index, action in enumerate(self.actions):
            self.prefetch(index + 1)  # receives are posted in action order, one tick ahead
            self.index = index
            self.execute(action)
            replicated = self.pipe.replicas.group is not None
            if replicated and self.training and self.pipe.last_backward.get(action.chunk) == index:
                self.sync_replicas(action.chunk)
        self.pipe.messenger.finish()
        self.sent_bytes = self.pipe.messenger.sent_bytes
        self.syncs += self.pipe.replicas.take_sync_times()

    def sync_replicas(self, chunk: int) -> None:
        """The chunk's gradients are complete: the data-parallel engine sums them across replicas."""
        start = time.perf_counter()
        self.pipe.replicas.after_last_backward(chunk)
        self.syncs.append((start, time.perf_counter()))

    def execute(self, action: Action) -> None:
        messenger = self.pipe.messenger
        messenger.wait_seconds = 0.0
        start = time.perf_counter()
        try:
            self.run_action(action)
        except comms.CommError:
            raise
        except Exception as error:
            stage = self._stage(action)
            raise StageError(
                f"rank {self.pipe.global_rank}: {action} (virtual stage {stage}) failed: {error}"
                + self._input_note(action)
            ) from error
        if self.pipe.device.type == "cuda":
            torch.cuda.synchronize(self.pipe.device)  # CUDA runs asynchronously: time kernels, not launches
        end = time.perf_counter()
        self.spans.append(Span(self.pipe.global_rank, action, start, end, messenger.wait_seconds))

    def run_action(self, action: Action) -> None:
        if action.op == "F":
            self.forward(action)
        elif action.op in "BI":
            self.backward(action)
        elif self.pipe.replicas.split_backward:  # else W's work was done by its I, run whole
            self.weight(action)

    def _input_note(self, action: Action) -> str:
        """For a failed forward: what the previous stage handed over, which names both stages."""
        stage = self._stage(action)
        if action.op != "F" or stage == 0:
            return ""
        sender = self.pipe.placement.owner(stage - 1)[0]
        received = getattr(self, "_last_input", None)
        shown = pytree.describe(received) if received is not None else "nothing"
        return f"; its input came from stage {stage - 1} (rank {sender}) as {shown}"

    def forward(self, action: Action) -> None:
        pipe, stage, mb = self.pipe, self._stage(action), action.microbatch
        if stage == 0:
            stage_input = self.inputs[mb]
        else:
            stage_input = pipe.messenger.receive_activation(stage, mb, self.sizes[mb])
            self._last_input = stage_input
            if self.training:
                for leaf in pytree.gradient_leaves(stage_input):
                    leaf.requires_grad_()
        with rng.keyed(pipe.steps_done, self.first_samples[mb]), pipe.precision.autocast(pipe.device):
            output = self._run_chunk(action.chunk, stage_input, (mb, action.chunk))
        if stage == pipe.num_virtual - 1:
            root = pipe.loss_fn(pipe.precision.for_loss(output), self.targets[mb]) * self.scales[mb]
            self.loss = root.detach() if self.loss is None else self.loss + root.detach()
        else:
            root = None
            pipe.messenger.send_activation(stage, mb, self.sizes[mb], output)
        if self.training:
            self.stash[(mb, action.chunk)] = _Stash(stage_input, output, root, self._captured)
            if self.meter:
                self.meter.hold((mb, action.chunk))

    def _run_chunk(self, chunk: int, stage_input, key: tuple[int, int]):
        """The chunk's forward; in training, its parameter outputs captured and its activations metered."""
        pipe = self.pipe
        if not self.training:  # whatever autograd would save is metered: nothing, under no_grad
            self._captured = []
            with self.meter.measuring(key, []) if self.meter else nullcontext():
                output = pipe.chunks[chunk](stage_input)
            if self.meter:
                self.meter.hold(key)
                self.meter.release(key)
            return output
        stashed: list[torch.Tensor] = pytree.leaves(stage_input)
        with self.meter.measuring(key, stashed) if self.meter else nullcontext():
            with pipe.parameter_outputs.capture() as self._captured:
                fed = _copy_floats(stage_input) if pipe.copies_input[chunk] else stage_input
                output = pipe.chunks[chunk](fed)
            stashed += pytree.leaves(output)
        return output

    def backward(self, action: Action) -> None:
        pipe, stage, mb = self.pipe, self._stage(action), action.microbatch
        key = (mb, action.chunk)
        stash = self.stash[key]
        if stage == pipe.num_virtual - 1:
            roots, grads = [stash.root], None
        else:
            received = pipe.messenger.receive_gradient(stage, mb, stash.output)
            roots, grads = gradient_roots(pytree.gradient_leaves(stash.output), received)
        inputs = [leaf for leaf in pytree.gradient_leaves(stash.stage_input) if leaf.requires_grad]
        replicas = pipe.replicas
        deferred = action.op == "I" and replicas.split_backward  # the weights' half waits for a W
        if not replicas.split_backward and pipe.last_backward[action.chunk] == self.index:
            replicas.before_last_backward(action.chunk, roots)
        whole = not replicas.split_backward
        # A whole backward is one autograd call when the graph must be kept for some module anyway (not
        # only Linears): splitting it into B then W would only add calls (measured: 5-9 % of a GPT step).
        whole_graph = pipe.parameter_outputs.keeps_graph or rebuilds_beyond_linears(stash.captured)
        if whole or (not deferred and (whole_graph or modified_in_place(stash.captured))):
            input_grads = backward_whole(roots, grads, inputs)  # plain autograd, same result
            self._done(*key)
        else:
            keep_graph = pipe.parameter_outputs.keeps_graph
            with pipe.parameter_outputs.rebuilding(stash.captured):
                input_grads, work = backward_input(roots, grads, inputs, stash.captured, keep_graph)
            if deferred:  # W comes later: hold only what it needs
                output, root = (stash.output, stash.root) if keep_graph else (None, None)
                self.stash[key] = _Stash(stash.stage_input, output, root, [], work)
                if self.meter:
                    self.meter.update(key, held_tensors(work), keep_graph)
            else:
                backward_weight(work)
                self._done(*key)
        if stage > 0:
            pipe.messenger.send_gradient(stage, mb, input_grads)

    def weight(self, action: Action) -> None:
        backward_weight(self.stash[(action.microbatch, action.chunk)].weight_work)
        self._done(action.microbatch, action.chunk)

    def _done(self, mb: int, chunk: int) -> None:
        del self.stash[(mb, chunk)]
        if self.meter:
            self.meter.release((mb, chunk))


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` in group order (the whole world for None)."""
    if group is None or not dist.is_initialized():
        return list(range(comms.get_world_size()))
    return dist.get_process_group_ranks(group)


def _copy_floats(tree):
    """A copy of the floating leaves, for a chunk whose first layer works in place on its input."""
    return pytree.tree_map(lambda leaf: leaf.clone() if pytree.carries_gradient(leaf) else leaf, tree)


def _warn_about_batch_norm(rank: int, chunks: list[nn.Module]) -> None:
    """BatchNorm's statistics are per micro-batch, by nature: the one place a pipeline changes the math."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for chunk in chunks for m in chunk.modules()):
        warnings.warn(
            f"rank {rank}: this stage holds a BatchNorm, which normalises over each micro-batch, not the "
            "whole batch: its results depend on the number of micro-batches (LayerNorm does not)",
            stacklevel=3,
        )


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
    module = getattr(module, "module", module)  # inside a DDP wrapper
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))


def _batch_size(tree, what: str) -> int:
    return -1 if tree is None else pytree.batch_size(tree, what)
