"""One rank of ``pipeclock lab N --check FILE``: run the learner's loop, step after step, and report.

The rank joins a gloo group, loads the learner's file with ``comms`` wrapped (`recorder.Recorder`),
and for each micro-batch count runs one step of the learner's function on a fresh ShardedMLP stage. It
tells the checker (`check`) everything through a queue: each message's call before it blocks and
after it completes (so a deadlock can be described), each fault it sees (a message or a gradient that is
not what the one-process model computes, a wrong loss, an exception), and its step's times. Every rank
computes the one-process reference itself: the model is small, and no message is needed to know it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeclock import comms, schedule
from pipeclock.course.recorder import ACTIVATION, Message, Pipe, Recorder
from pipeclock.model import ShardedMLP

TOLERANCE = 1e-5  # relative to the largest value of the tensor compared


@dataclass(frozen=True)
class Case:
    """One step to check: ``m`` micro-batches on a model of ``layers`` x ``hidden``, a batch of ``batch``."""

    m: int
    hidden: int = 8
    layers: int = 8
    batch: int = 11
    timed: bool = False  # the step whose bubble is measured (a larger model, run twice)


@dataclass(frozen=True)
class Fault:
    """What a rank found wrong; ``order`` sorts faults so that the earliest cause comes first."""

    rank: int
    case: Case
    order: tuple
    text: str


def load_function(path: Path, name: str):
    """The learner's function ``name`` from the file at ``path``."""
    spec = importlib.util.spec_from_file_location(f"learner_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise LookupError(f"{path} defines no function {name}(...)")
    return function


class Reference:
    """What the one-process model computes for a case: every stage boundary's activation and gradient per
    micro-batch, the parameters' gradients (whole, and each micro-batch's share), and the loss."""

    def __init__(self, case: Case, stages: int, seed: int = 0) -> None:
        self.inputs, self.targets = batch_of(case)
        whole = ShardedMLP(case.hidden, case.layers, 0, 1, seed)
        loss = F.mse_loss(whole(self.inputs), self.targets)
        loss.backward()
        self.loss = loss.item()
        self.grads = {name: p.grad.clone() for name, p in whole.named_parameters()}
        self.sent: dict[tuple[str, int, int], torch.Tensor] = {}
        self.shares: list[dict[str, torch.Tensor]] = []
        parts = [ShardedMLP(case.hidden, case.layers, s, stages, seed) for s in range(stages)]
        pieces = zip(*(schedule.split_microbatches(t, case.m) for t in batch_of(case)), strict=True)
        for i, (x, target) in enumerate(pieces):
            for part in parts:
                part.zero_grad()
            ins, h = [], x
            for stage, part in enumerate(parts):
                if stage > 0:
                    h.retain_grad()  # the gradient a stage sends back: the one of its input
                ins.append(h)
                h = part(h)
                self.sent[ACTIVATION, i, stage] = h.detach()
            (F.mse_loss(h, target) * len(target) / case.batch).backward()
            for stage in range(1, stages):
                self.sent["gradient", i, stage] = ins[stage].grad
            self.shares.append({n: p.grad.clone() for part in parts for n, p in part.named_parameters()})


def batch_of(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case.m * 7919 + case.batch)
    return torch.randn(case.batch, case.hidden, generator=generator), torch.randn(
        case.batch, case.hidden, generator=generator
    )


def gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.detach().float() - want).abs().max().item()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and gap(got, want) <= TOLERANCE * max(want.abs().max().item(), 1e-6)


class RankCheck:
    """This rank's side of the check: runs the cases, reports to ``events``."""

    def __init__(self, rank: int, world: int, chunks: int, learner: Path, function: str, events) -> None:
        self.rank, self.world, self.chunks, self.events = rank, world, chunks, events
        self.learner, self.function_name = learner.resolve(), function
        self.case: Case | None = None
        self.reference: Reference | None = None
        self.recorder = Recorder(rank, Pipe(world, chunks, 1), self._waits, self._did, self._sent)

    # --- reports -----------------------------------------------------------------------------------------

    def _put(self, *event) -> None:
        self.events.put((event[0], self.rank, self.case, *event[1:]))

    def _waits(self, text: str) -> None:
        self._put("waits", text)

    def _did(self, text: str) -> None:
        self._put("did", text)

    def _fault(self, order: tuple, text: str) -> None:
        self.events.put(("fault", self.rank, self.case, Fault(self.rank, self.case, order, text)))

    def _sent(self, message: Message, tensor: torch.Tensor) -> None:
        """Compare a tensor as it leaves with what the one-process model has there."""
        forward = message.kind == ACTIVATION
        order = (message.microbatch, 0 if forward else 1, message.stage if forward else -message.stage)
        if message.microbatch < 0:
            self._fault(
                (self.case.m, 2, 0), f"rank {self.rank} sent one {message.kind} more than the step has"
            )
            return
        want = self.reference.sent[message.kind, message.microbatch, message.stage]
        where = f"rank {self.rank}, micro-batch {message.microbatch}, {'forward' if forward else 'backward'}"
        if not isinstance(tensor, torch.Tensor):
            self._fault(order, f"{where}: sent {type(tensor).__name__}, not a tensor")
        elif tensor.shape != want.shape:
            self._fault(
                order,
                f"{where}: sent {message} with shape {tuple(tensor.shape)}, "
                f"the one-process model's has shape {tuple(want.shape)}",
            )
        elif not close(tensor, want):
            self._fault(
                order,
                f"{where}: sent a wrong {message.kind}: it differs from the one-process "
                f"model's by up to {gap(tensor, want):.3g} (largest value {want.abs().max().item():.3g})"
                f"{ratio_hint(tensor, want)}",
            )

    # --- running -----------------------------------------------------------------------------------------

    def run(self, cases: list[Case]) -> None:
        function = load_function(self.learner, self.function_name)
        self._put("started")
        for case in cases:
            self.case, self.reference = case, Reference(case, self.world * self.chunks)
            self.run_case(function, case)
        self.case = None
        self._put("finished")

    def run_case(self, function, case: Case) -> None:
        for _ in range(2 if case.timed else 1):
            chunks = ShardedMLP.for_rank(case.hidden, case.layers, self.rank, self.world, chunks=self.chunks)
            self.recorder.restart(Pipe(self.world, self.chunks, case.m))
            self._put("waits", "for the others to start the step")
            comms.barrier("starting a step")
            self._put("begin")
            start = time.monotonic()
            loss = self.call(function, chunks, case)
            end = time.monotonic()
            self._put("step done", start, end, self.recorder.blocked)
            self.check_results(chunks, loss)
            self._put("waits", "for the others to finish the step")
            comms.barrier("ending a step")

    def call(self, function, chunks: list[ShardedMLP], case: Case):
        stage = chunks if self.chunks > 1 else chunks[0]
        inputs = self.reference.inputs if self.rank == 0 else None
        targets = self.reference.targets if self.rank == self.world - 1 else None
        try:
            return function(stage, inputs, targets, case.m)
        except Exception as error:  # the learner's bug: said in one line, with its place in their file
            self._fault((-1, 0, 0), f"rank {self.rank} raised {describe_exception(error, self.learner)}")
            self.events.close()
            self.events.join_thread()  # the report is out before the process ends
            sys.stdout.flush()
            os._exit(1)

    def check_results(self, chunks: list[ShardedMLP], loss) -> None:
        last = self.rank == self.world - 1
        want = self.reference.loss
        if last and not (
            isinstance(loss, float | int | torch.Tensor) and abs(float(loss) - want) <= 1e-5 * abs(want)
        ):
            self._fault(
                (self.case.m, 3, 0),
                f"rank {self.rank} returned the loss {loss!r}; the batch's loss is {want:.6g}",
            )
        for chunk in chunks:
            for name, parameter in chunk.named_parameters():
                self.check_gradient(name, parameter.grad)

    def check_gradient(self, name: str, got: torch.Tensor | None) -> None:
        want = self.reference.grads[name]
        order = (self.case.m, 4, 0)
        if got is None:
            self._fault(order, f"rank {self.rank}: {name} has no gradient: no backward reached it")
        elif not close(got, want):
            blame = self.blame(name, got)
            self._fault(
                order,
                f"rank {self.rank}: the gradient of {name} differs from the one-process "
                f"model's by up to {gap(got, want):.3g} (largest value {want.abs().max().item():.3g}){blame}",
            )

    def blame(self, name: str, got: torch.Tensor) -> str:
        """Which micro-batch's backward went missing (or ran twice), when one explains the difference."""
        want = self.reference.grads[name]
        for i, share in enumerate(self.reference.shares):
            if close(got, want - share[name]):
                return f": micro-batch {i}'s backward never reached it"
            if close(got, want + share[name]):
                return f": micro-batch {i}'s backward reached it twice"
        return ratio_hint(got, want)


def ratio_hint(got: torch.Tensor, want: torch.Tensor) -> str:
    """``; it is 0.5 times the right one`` when the difference is a scale (a loss weighted wrongly)."""
    denominator = (want * want).sum().item()
    if denominator == 0:
        return ""
    scale = (got.detach().float() * want).sum().item() / denominator
    if abs(scale - 1) > 1e-3 and close(got, want * scale):
        return f"; it is {scale:.4g} times the right one (a loss weighted by the wrong count?)"
    return ""


def describe_exception(error: BaseException, learner: Path) -> str:
    """``ValueError: ... (line 12 of FILE: `code`)``: the learner's deepest line in the traceback."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == learner]
    text = f"{type(error).__name__}: {error}".strip()
    if not frames:
        return text
    frame = frames[-1]
    return f"{text} (line {frame.lineno} of {os.path.relpath(learner)}: `{(frame.line or '').strip()}`)"


def run_rank(
    rank: int, world: int, port: int, chunks: int, learner: str, function: str, cases, events
) -> None:
    """A process's whole life: join the group, check every case, leave."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    comms.init("gloo", timeout=300.0)  # the checker's own stall detection comes first
    check = RankCheck(rank, world, chunks, Path(learner), function, events)
    with check.recorder:
        check.run(cases)
    comms.shutdown()
