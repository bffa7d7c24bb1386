"""A rank's share of a pipeline: the schedule it runs, the checks every rank agrees on, and the step.

``Pipeline.step`` cuts the batch into micro-batches, then walks this rank's actions in order
(``pipeclock.engine.step_run``). Each action is one "tick": ``F`` runs a micro-batch forward through
one local chunk, ``B`` runs it backward (or only its input-gradient half), ``W`` finishes the weight
gradients. What to receive before a tick and what to send after it follows from the action alone
(``pipeclock.engine.messenger``); the loop never asks which schedule it is running.

The math is the one-device math: each micro-batch's loss is weighted by its share of what the batch's
loss averages over (samples, or counted tokens: ``pipeclock.engine.losses``), dropout masks are keyed by
sample rather than drawn (``pipeclock.engine.rng``), and tied weights get their copies' gradients
summed (``pipeclock.engine.ties``), so after a step every ``.grad`` holds what the whole model on one
process computes for the whole batch.

``evaluate`` runs the same forwards without building any graph: the validation loss, on every rank.
"""

from __future__ import annotations

import functools
import time
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeclock import comms
from pipeclock.engine import faults, pytree
from pipeclock.engine.action_clock import clock_for
from pipeclock.engine.actions import (
    Action,
    Schedule,
    forward_only,
    join_first_stage_backwards,
    placement_of,
    validate,
)
from pipeclock.engine.backward import ParameterOutputs
from pipeclock.engine.generators import Generator, generate
from pipeclock.engine.limits import MAX_MICROBATCHES
from pipeclock.engine.losses import LossFn
from pipeclock.engine.memory import ActivationMeter
from pipeclock.engine.messenger import Messenger
from pipeclock.engine.microbatch import microbatch_sizes
from pipeclock.engine.precision import Precision, parse_precision
from pipeclock.engine.program import add_reduce_grad, lower
from pipeclock.engine.program_run import must_finish
from pipeclock.engine.recompute import RecomputePolicy, apply_recompute
from pipeclock.engine.replicas import Replicas, SinglePipeline
from pipeclock.engine.spans import Span
from pipeclock.engine.step_ends import DIFFERS, GIVEN_NONE, NOT_HERE, REJECTED, StepEnds
from pipeclock.engine.step_run import BatchRefused, StageError, StepRun
from pipeclock.engine.ties import TiedGradients
from pipeclock.engine.tp_batch import ENDS, TensorParallelPeers, tp_group_of

__all__ = ["BatchRefused", "Pipeline", "StageError", "StepRecord"]


@dataclass
class StepRecord:
    """What one step did on this rank: its loss, duration, spans and measured activation peak."""

    loss: float
    seconds: float
    spans: list[Span]
    peak_activation_bytes: int | None
    syncs: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each dp gradient sum
    sent_bytes: int = 0  # activations and gradients this rank sent to its pipeline neighbours
    # time inside tensor parallel's collectives and their number, where the step was profiled for them
    # (``pipeclock.observe.collectives``); None: not profiled
    collective_seconds: float | None = None
    collective_calls: int = 0

    @property
    def sync_seconds(self) -> float:
        """Time during which gradients were being summed across replicas (overlapping sums once)."""
        total, reached = 0.0, float("-inf")
        for start, end in sorted(self.syncs):
            total += max(0.0, end - max(start, reached))
            reached = max(reached, end)
        return total


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
    of the global batch, and the returned loss is the global batch's. ``tp_group``: the ranks that share
    this stage by tensor parallel (default: the ``"tp"`` dim of the mesh its split parameters live on);
    they must be given the same batch, which each step checks where the batch is read
    (``pipeclock.engine.tp_batch``: one all-reduce of a checksum or two).

    ``recompute`` (``"none"``, ``"full"``, ``"every-K"``: ``pipeclock.engine.recompute``) checkpoints the
    chunks' blocks, in place: the same math with less activation memory. ``dtype="bf16"`` runs the
    forwards under autocast with float32 weights and gradients, and sends bf16 messages
    (``pipeclock.engine.precision``).
    The program each rank runs is ``programs[rank]``; ``evaluate`` runs ``evaluation_programs``.
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
        tp_group: dist.ProcessGroup | None = None,
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
        self.num_virtual = self.placement.num_virtual
        self.first_rank = self.placement.owner(0)[0]
        self.last_rank = self.placement.owner(self.num_virtual - 1)[0]
        self.precision = parse_precision(dtype)
        wire = self.precision.wire_dtype
        self.messenger = Messenger(self.rank, self.placement, self.peers, wire, self.table)
        recomputed = apply_recompute(self.chunks, recompute)
        defers = self.replicas.split_backward and any(a.op == "I" for a in self.actions)
        self.parameter_outputs = ParameterOutputs(self.chunks, recomputed, defers_weights=defers)
        w_keeps_graph = defers and self.parameter_outputs.keeps_graph
        self.meter = ActivationMeter(self.chunks, w_keeps_graph) if measure_memory else None
        self.copies_input = [_starts_in_place(chunk) for chunk in self.chunks]
        self.device = comms.device()
        self.new_clock = functools.partial(clock_for, self.device)  # what times each step's actions
        self.tp_peers = TensorParallelPeers(tp_group or tp_group_of(self.chunks), self.device)
        self.ties = TiedGradients(self.chunks, group)
        self.last_backward = self._last_backward_actions()
        replicated = self.replicas.group is not None
        written = getattr(schedule, "programs", None)  # a compute_comms file runs as written
        self.programs = (
            [add_reduce_grad(program) if replicated else program for program in written]
            if written
            else lower(self.table, replicas=replicated, ties=True)
        )
        evaluation = forward_only(Schedule(self.table, self.placement))
        self.evaluation_programs = lower(evaluation, replicas=replicated)
        self.ends = StepEnds(self.rank, self.peers, self.first_rank, self.last_rank, self.device)
        self._configuration_agreed = False
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
            must_finish(table)  # a custom schedule must be able to finish: DeadlockError if not
        return table if getattr(table, "programs", None) else join_first_stage_backwards(table)

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

    def _last_backward_actions(self) -> dict[int, Action]:
        """For each chunk, the action after which its gradients are complete for the step."""
        weights = "BW" if self.replicas.split_backward else "BI"
        return {a.chunk: a for a in self.actions if a.op in weights}

    # --- one training step -----------------------------------------------------------------------------

    def step(self, inputs=None, targets=None) -> float:
        """Forward and backward over the batch; returns the batch's mean loss (a float) on every rank.

        ``inputs`` (a tensor or pytree) are read on the first stage and ``targets`` on the last; other
        ranks may pass None. Gradients accumulate into ``.grad`` as after ``loss.backward()``: zeroing
        them and the optimizer step stay the caller's.
        """
        start = time.perf_counter()
        run = StepRun(self, inputs, targets)
        with self.precision.step_region(self.device):
            run.run()
        loss = run.shared_loss
        peak = self.meter.peak if self.meter else None
        self.last = StepRecord(loss, time.perf_counter() - start, run.spans, peak, run.syncs, run.sent_bytes)
        self.steps_done += 1
        return loss

    def evaluate(self, inputs=None, targets=None) -> float:
        """The batch's mean loss, forward only: no graph built, no activation held, dropout off.

        Every rank calls it together, like ``step``; the modules are in ``eval()`` mode meanwhile and
        return to their own mode after.
        """
        modes = [chunk.training for chunk in self.chunks]
        run = StepRun(self, inputs, targets, training=False)
        try:
            for chunk in self.chunks:
                chunk.eval()
            with torch.no_grad(), self.precision.step_region(self.device):
                run.run()
        finally:
            for chunk, mode in zip(self.chunks, modes, strict=True):
                chunk.train(mode)
            self.replicas.end_evaluation()
        return run.shared_loss

    def _send_sizes(self, inputs, targets) -> tuple[list[int], ValueError | None]:
        """``SIZES``: send the batch sizes of the ends this rank holds and post the others' receives
        (``pipeclock.engine.step_ends``); this rank's sizes and the error its own batch raised, if any
        (raised at ``AGREE``, once every rank has heard). The configuration is agreed on the first step.
        """
        if not self._configuration_agreed:
            self._agree_on_configuration()
        self.ties.prepare()  # collective on the first step: before a first stage may run ahead
        mine, rejection = self._sizes_given(inputs, targets)
        faults.point("gather", self.steps_done)
        self.ends.send_batch_sizes(mine)
        return mine, rejection

    def _confirm_batch(self, rejection: ValueError | None = None) -> list[int]:
        """``AGREE``: read the ends' batch sizes and check them: the micro-batch sizes, or
        ``BatchRefused`` on every rank of the pipeline (and of its replicas) alike, before any
        activation leaves."""
        batch, target_batch, input_shapes = self.ends.batch_sizes()
        self.messenger.new_input_shapes(input_shapes)
        try:
            if rejection is not None:
                raise ValueError(f"rank {self.global_rank}: {rejection}")
            self._check_batch(batch, target_batch)
            sizes = self._microbatch_sizes(batch)
        except ValueError as error:  # complete what was sent, tell the replicas
            self.ends.wait_sends()
            self.messenger.abandon()
            self.replicas.refuse_batch()
            raise BatchRefused(str(error)) from None
        try:
            self.first_sample = self.replicas.first_sample(batch)
        except ValueError as error:  # another replica refused its batch
            self.ends.wait_sends()
            raise BatchRefused(str(error)) from None
        self.ends.expect_loss()
        return sizes

    def _microbatch_sizes(self, batch: int) -> list[int]:
        try:
            return microbatch_sizes(batch, self.num_microbatches)
        except ValueError as error:
            raise ValueError(f"rank {self.global_rank}: {error}") from None

    def _sizes_given(self, inputs, targets) -> tuple[list[int], ValueError | None]:
        """The batch sizes of the ends this rank holds and the inputs' shape key (``NOT_HERE`` for what it
        does not hold), and the error that one of them raised: it is raised once every rank has heard."""
        held = (self.rank == self.first_rank, self.rank == self.last_rank)
        mine, rejection = [NOT_HERE, NOT_HERE, NOT_HERE], None
        for index, tree, what in ((0, inputs, "the inputs"), (1, targets, "the targets")):
            if held[index]:
                try:
                    mine[index] = _batch_size(tree, what)
                except ValueError as error:
                    mine[index], rejection = REJECTED, error
        if mine[0] >= 0:
            mine[2] = pytree.shape_key(inputs)
        given = {end: tree for end, tree, here in zip(ENDS, (inputs, targets), held, strict=True) if here}
        differing = self.tp_peers.differing(given)
        if differing and rejection is None:
            stage = " and ".join({"inputs": "first", "targets": "last"}[end] for end in differing) + " stage"
            rejection = ValueError(self.tp_peers.refusal(differing, stage))
            for index, end in enumerate(ENDS):
                mine[index] = DIFFERS if end in differing else mine[index]
        return mine, rejection

    def _check_batch(self, batch: int, target_batch: int) -> None:
        """Raise, on every rank alike, if the ends were given no batch, an unreadable one, or two sizes."""
        ends = (
            (batch, self.first_rank, "first", "inputs", "inputs tensor"),
            (target_batch, self.last_rank, "last", "targets", "targets"),
        )
        for size, end, stage, given, none in ends:
            where = f"rank {self.global_rank}: the {stage} stage (rank {self.peers[end]})"
            if size == GIVEN_NONE:
                raise ValueError(f"{where} was given no {none}")
            if size == REJECTED:
                raise ValueError(f"{where} could not read its {given} (its own error says why)")
            if size == DIFFERS:
                raise ValueError(
                    f"{where} and its tp peers were given different {given} (its error says more)"
                )
        if batch != target_batch:
            raise ValueError(
                f"rank {self.global_rank}: {batch} inputs but {target_batch} targets in the batch"
            )

    def _agree_on_configuration(self) -> None:
        """Check once that every rank runs the same micro-batch count, chunks and schedule.

        One all-reduce taking the maximum of each value and of its negation: every rank sees whether all
        agree (the largest value equals the smallest). Only when they do not are the ranks' values
        gathered, to name them in the error.
        """
        agreed = [self.num_microbatches, len(self.chunks), self._fingerprint]
        if self.num_stages > 1:
            both = torch.tensor(agreed + [-value for value in agreed], dtype=torch.int64, device=self.device)
            what = "agreeing on the batch and schedule"
            reduced = comms.all_reduce(both, what, self.group, op=dist.ReduceOp.MAX).tolist()
            if reduced[: len(agreed)] != [-value for value in reduced[len(agreed) :]]:
                self._disagreement(agreed)
        self._configuration_agreed = True

    def _disagreement(self, mine: list[int]) -> None:
        """Some rank runs another configuration: every rank gathers them all and raises the same error."""
        row = torch.tensor(mine, dtype=torch.int64, device=self.device)
        rows = [r.tolist() for r in comms.all_gather(row, "agreeing on the batch and schedule", self.group)]
        described = "; ".join(
            f"rank {self.peers[r]}: m={row[0]}, chunks={row[1]}" for r, row in enumerate(rows)
        )
        raise ValueError(
            f"rank {self.global_rank}: ranks disagree on micro-batches, chunks or schedule ({described})"
        )

    def _share_loss(self, loss: torch.Tensor | None) -> float:
        """The global batch's loss on every rank: summed over the replicas, sent from the last stage."""
        value = torch.zeros((), dtype=torch.float64, device=self.device) if loss is None else loss.double()
        if self.rank == self.last_rank:
            value = self.replicas.total(value, "summing the replicas' losses")
        faults.point("loss", self.steps_done)
        return self.ends.share_loss(value)

    def global_total(self, local: int) -> int:
        """A count (samples or tokens) summed over the data-parallel replicas' shards of the batch."""
        value = torch.tensor(local, dtype=torch.int64, device=self.device)
        return int(self.replicas.total(value, "adding up the global batch"))


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` in group order (the whole world for None)."""
    if group is None or not dist.is_initialized():
        return list(range(comms.get_world_size()))
    return dist.get_process_group_ranks(group)


BATCH_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)


def _warn_about_batch_norm(rank: int, chunks: list[nn.Module]) -> None:
    """BatchNorm's statistics are per micro-batch, by nature: the one place a pipeline changes the math."""
    if any(isinstance(m, BATCH_NORMS) for chunk in chunks for m in chunk.modules()):
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
    return GIVEN_NONE if tree is None else pytree.batch_size(tree, what)
