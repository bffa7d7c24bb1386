"""One rank of ``pipeclock lab N --check FILE``: run the learner's loop, step after step, and report.

The rank joins a gloo group, loads the learner's file with ``comms`` wrapped (`recorder.Recorder`) and
hooks on its model chunks (`computes.Computes`), and for each micro-batch count runs one step of the
learner's function on a fresh ShardedMLP stage. It tells the checker (`check`) everything through a
queue: each forward and backward it computes, each message's call before it blocks and after it
completes (so a deadlock can be described), each fault it sees (a message or a gradient that is not
what the one-process model computes, a wrong loss, an exception), and the end of each step. Whatever
happens, the process ends without printing a traceback: the checker says what went wrong, in one line.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeclock import comms
from pipeclock.comm_errors import CommError, ShapeMismatchError
from pipeclock.course.computes import Computes
from pipeclock.course.learner_file import line_by_line, load_function
from pipeclock.course.recorder import ACTIVATION, GRADIENT, Message, Pipe, Recorder
from pipeclock.course.reference import Case, Reference, close, gap
from pipeclock.course.saved import HeldMeter
from pipeclock.model import ShardedMLP

# How faults of one case are ranked (then by `Fault.order`): a cause before what follows from it.
# A peer's failure seen by a rank (its connection lost) comes last: the rank that failed says why itself.
CAUSE, ORDER, RESULT, CONSEQUENCE, PEER = 0, 1, 2, 3, 4
NEVER_WAITED = (
    "with comms.isend_tensor and never waited for it: isend_tensor returns at once, the send may not have "
    "left when the step ends; post the sends and wait for them all at the end (.wait() for each)"
)
NO_GRAD_HINT = "x.grad stays None unless the input was marked with x.requires_grad_() before the forward"


@dataclass(frozen=True)
class Fault:
    """What a rank found wrong: ``tier`` (CAUSE ... PEER), then ``order`` (rank or ``when``) rank the
    faults of a case.
    ``symptom``: what a wrong order would explain (a wrong number, a shape, a lost peer): when the order
    went wrong before it, the verdict says the order first."""

    rank: int
    case: Case
    tier: int
    when: float
    text: str
    symptom: bool = False
    raised: bool = False  # the learner's own code raised it: the verdict adds where the order stood

    @property
    def order(self) -> tuple:
        # the results are checked at each step's end on every rank, and the learner's code may raise on
        # several ranks at about the same moment: of those, the lowest rank's comes first, whichever
        # process the machine ran first, so that a file gets the same verdict every run
        by_rank = self.tier == RESULT or self.raised
        return (self.case.m, self.tier, self.raised, self.rank if by_rank else 0, self.when)


class RankCheck:
    """This rank's side of the check: runs the cases, reports to ``events``."""

    def __init__(self, rank: int, world: int, chunks: int, learner: Path, function: str, events) -> None:
        self.rank, self.world, self.chunks, self.events = rank, world, chunks, events
        self.learner, self.function_name = learner.resolve(), function
        self.case: Case | None = None
        self.reference: Reference | None = None
        self.pipe = Pipe(world, chunks, 1)
        self.recorder = Recorder(rank, self.pipe, self._waits, self._did, self._sent, self._message)

    # --- reports -----------------------------------------------------------------------------------------

    def _put(self, *event) -> None:
        self.events.put((event[0], self.rank, self.case, *event[1:]))

    def _waits(self, text: str) -> None:
        self._put("waits", text)

    def _did(self, text: str) -> None:
        self._put("did", text)

    def _message(self, event: str, peer: int, tag: int, message: Message) -> None:
        self._put("message", event, peer, tag, message)
        if event == "send" and message.microbatch >= 0:
            self.check_destination(peer, message)

    def check_destination(self, dest: int, message: Message) -> None:
        """A message goes to the rank of the next virtual stage (an activation) or the previous one."""
        forward = message.kind == ACTIVATION
        stage = message.stage + (1 if forward else -1)
        owner = stage % self.world
        if dest != owner:
            ring = "; round the ring, rank p − 1 sends to rank 0" if self.chunks > 1 and forward else ""
            self.fault(
                CAUSE,
                f"rank {self.rank} sent {message} (leaving virtual stage {message.stage}) to rank {dest}; "
                f"virtual stage {stage} is rank {owner}'s{ring}",
            )

    def fault(self, tier: int, text: str, symptom: bool = False, raised: bool = False) -> None:
        symptom = symptom or tier >= RESULT
        found = Fault(self.rank, self.case, tier, time.monotonic(), text, symptom, raised)
        self.events.put(("fault", self.rank, self.case, found))

    def _computed(self, action) -> None:
        self._put("computed", (action.op, action.microbatch, action.chunk))

    def _sent(self, message: Message, tensor: torch.Tensor) -> None:
        """Compare a tensor as it leaves with what the one-process model has there."""
        forward = message.kind == ACTIVATION
        if self.chunks > 1 and self.on_the_other_tag(message, tensor):
            return
        if message.microbatch < 0:
            self.fault(CAUSE, f"rank {self.rank} sent one {message.kind} more than the step has", True)
            return
        want = self.reference.sent[message.kind, message.microbatch, message.stage]
        where = f"rank {self.rank}, micro-batch {message.microbatch}, {'forward' if forward else 'backward'}"
        if tensor is None and not forward:
            self.fault(CAUSE, f"{where}: sent None, not a gradient: {NO_GRAD_HINT}")
        elif not isinstance(tensor, torch.Tensor):
            self.fault(CAUSE, f"{where}: sent {type(tensor).__name__}, not a tensor")
        elif (other := self.reference.which(message.kind, message.stage, tensor)) not in (
            None,
            message.microbatch,
        ):
            shapes = f" (shape {tuple(tensor.shape)})" if tensor.shape != want.shape else ""
            due = f" (shape {tuple(want.shape)})" if shapes else ""
            self.fault(
                CAUSE,
                f"{where}: sent {article(message.kind)} that is micro-batch {other}'s{shapes}, "
                f"where micro-batch {message.microbatch}'s{due} is due",
            )
        elif tensor.shape != want.shape:
            self.fault(
                CAUSE,
                f"{where}: sent {message} with shape {tuple(tensor.shape)}, "
                f"the one-process model's has shape {tuple(want.shape)}{self.whole_batch(tensor)}",
                True,
            )
        elif not close(tensor, want) and (found := self.reference.anywhere(message.kind, tensor)):
            self.fault(
                CAUSE,
                f"{where}: sent the {message.kind} of micro-batch {found[0]} leaving virtual stage "
                f"{found[1]}, where micro-batch {message.microbatch}'s leaving virtual stage "
                f"{message.stage} is due",
                True,
            )
        elif not close(tensor, want):
            self.fault(
                CAUSE,
                f"{where}: sent a wrong {message.kind}: it differs from the one-process "
                f"model's by up to {gap(tensor, want):.3g} (largest value {want.abs().max().item():.3g})"
                f"{ratio_hint(tensor, want)}",
                True,
            )

    def whole_batch(self, tensor: torch.Tensor) -> str:
        if tensor.dim() and tensor.shape[0] == self.case.batch and self.case.m > 1:
            return ": the whole batch, not a micro-batch (cut it with schedule.split_microbatches)"
        return ""

    def on_the_other_tag(self, message: Message, tensor) -> bool:
        """Round a ring the tag says which stream a message is: a gradient sent with the activations' tag
        (or the other way round) is named so."""
        other = GRADIENT if message.kind == ACTIVATION else ACTIVATION
        found = self.reference.anywhere(other, tensor) if isinstance(tensor, torch.Tensor) else None
        if found is None or self.reference.anywhere(message.kind, tensor) is not None:
            return False
        tag = 0 if message.kind == ACTIVATION else 1
        self.fault(
            CAUSE,
            f"rank {self.rank} sent the {other} of micro-batch {found[0]} with tag {tag}, the "
            f"{message.kind}s' tag: activations travel with tag 0 and gradients with tag 1, so that the two "
            "streams between two ranks never mix",
        )
        return True

    # --- running -----------------------------------------------------------------------------------------

    def run(self, function, cases: list[Case]) -> None:
        self._put("started")
        for case in cases:
            self.case, self.reference = case, Reference(case, self.world * self.chunks)
            self.run_case(function, case)
        self.case = None
        self._put("finished")

    def run_case(self, function, case: Case) -> None:
        chunks = ShardedMLP.for_rank(case.hidden, case.layers, self.rank, self.world, chunks=self.chunks)
        self.pipe = Pipe(self.world, self.chunks, case.m)
        self.recorder.restart(self.pipe)
        computes = Computes(chunks, self._identify, self._fallback, self._computed)
        self._put("waits", "for the others to start the step")
        meter = HeldMeter(lambda: None if computes.current is None else (computes.current, computes.chunk))
        comms.barrier("starting a step")
        self._put("begin")
        with meter:
            loss = self.call(function, chunks, case)
        computes.remove()
        if self.recorder.unwaited:
            self.fault(CAUSE, f"rank {self.rank} posted {self.recorder.unwaited[0]} {NEVER_WAITED}")
        self._put("held", meter.peak)
        self._put("step done")
        self.check_results(chunks, loss)
        self._put("checked")
        self._put("waits", "for the others to finish the step")
        comms.barrier("ending a step")

    def _identify(self, chunk: int, x: torch.Tensor) -> int | None:
        return self.reference.entering_which(self.pipe.stage(self.rank, chunk), x)

    def _fallback(self, chunk: int, k: int) -> int:
        order = [i for i, c in self.pipe.forward_order() if c == chunk]
        return order[k] if k < len(order) else len(order)

    def call(self, function, chunks: list[ShardedMLP], case: Case):
        stage = chunks if self.chunks > 1 else chunks[0]
        inputs = self.reference.inputs if self.rank == 0 else None
        targets = self.reference.targets if self.rank == self.world - 1 else None
        try:
            return function(stage, inputs, targets, case.m)
        except BaseException as error:  # the learner's bug, said in one line with its place in their file
            # another shape than it expected: what the sender sent, whose own fault comes first; a peer
            # lost: that peer's own fault comes first
            tier = CAUSE if not isinstance(error, CommError) else PEER
            tier = CONSEQUENCE if isinstance(error, ShapeMismatchError) else tier
            asked = self.asked_for_another() if isinstance(error, ShapeMismatchError) else None
            if asked:
                self.fault(CAUSE, asked, True)  # a wrong order, when one is seen, says it first
            self.fault(
                tier, f"rank {self.rank} {describe_exception(error, self.learner)}", raised=tier == CAUSE
            )
            leave(self.events, 1)

    def asked_for_another(self) -> str | None:
        """A receive that asked for another micro-batch's shape than the message due there: the
        receiver's own loop is on another micro-batch than its schedule."""
        if self.recorder.asked is None or self.recorder.asked[0].microbatch < 0:
            return None
        message, shape = self.recorder.asked
        forward = message.kind == ACTIVATION
        sender = message.stage - 1 if forward else message.stage + 1
        shapes = [tuple(self.reference.sent[message.kind, i, sender].shape) for i in range(self.case.m)]
        if shape is None or shape == shapes[message.microbatch] or shape not in shapes:
            return None
        other = shapes.index(shape)
        op = "F" if forward else "B"
        return (
            f"rank {self.rank} asked for {message} with micro-batch {other}'s shape {shape}: its loop runs "
            f"{op}{other} where the schedule runs {op}{message.microbatch}"
        )

    def check_results(self, chunks: list[ShardedMLP], loss) -> None:
        last = self.rank == self.world - 1
        want = self.reference.loss
        if last and not (
            isinstance(loss, float | int | torch.Tensor) and abs(float(loss) - want) <= 1e-5 * abs(want)
        ):
            self.fault(RESULT, f"rank {self.rank} returned the loss {loss!r}; the batch's loss is {want:.6g}")
        for chunk in chunks:
            for name, parameter in chunk.named_parameters():
                self.check_gradient(name, parameter.grad)

    def check_gradient(self, name: str, got: torch.Tensor | None) -> None:
        want = self.reference.grads[name]
        if got is None:
            self.fault(RESULT, f"rank {self.rank}: {name} has no gradient: no backward reached it")
        elif not close(got, want):
            blame = self.blame(name, got)
            self.fault(
                RESULT,
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
            if len(self.reference.shares) > 1 and close(got, share[name]):
                return f": it is micro-batch {i}'s share alone (were the gradients zeroed between backwards?)"
        return ratio_hint(got, want)


def article(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def ratio_hint(got: torch.Tensor, want: torch.Tensor) -> str:
    """``; it is 0.5 times the right one`` when the difference is a scale (a loss weighted wrongly)."""
    denominator = (want * want).sum().item()
    if denominator == 0:
        return ""
    if not got.detach().any():
        return "; it is all zeros (sent before the backward computed it?)"
    scale = (got.detach().float() * want).sum().item() / denominator
    if abs(scale - 1) > 1e-3 and close(got, want * scale):
        return f"; it is {scale:.4g} times the right one (a loss weighted by the wrong count?)"
    return ""


def describe_exception(error: BaseException, learner: Path) -> str:
    """``raised ValueError: ... (line 12 of FILE: `code`)``: the learner's deepest line in the traceback,
    with a hint where the cause is a common one."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == learner]
    if isinstance(error, SystemExit):
        text = f"called sys.exit({error.code!r})"
    else:
        text = f"raised {type(error).__name__}: {error}".strip()
    if not frames:
        return text
    frame = frames[-1]
    line = (frame.line or "").strip()
    hint = f"; {NO_GRAD_HINT}" if isinstance(error, AttributeError) and ".grad" in line else ""
    return f"{text} (line {frame.lineno} of {os.path.relpath(learner)}: `{line}`){hint}"


def leave(events, code: int) -> None:
    """End this process at once, its reports delivered: no traceback, no cleanup that could print one."""
    try:
        events.close()
        events.join_thread()
        sys.stdout.flush()
    finally:
        os._exit(code)


def run_rank(
    rank: int, world: int, store: str, chunks: int, learner: str, function: str, cases, events
) -> None:
    """A process's whole life: join the group, check every case, leave. Whatever ends it early (a peer
    gone, an error in the learner's file at import) is one report, never a traceback."""
    with open(os.devnull, "w") as quiet:  # gloo's and the store's complaints when a peer is gone
        os.dup2(quiet.fileno(), 2)  # (C++, straight to the file): the verdict says what happened
    line_by_line()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    for inherited in ("MASTER_ADDR", "MASTER_PORT"):  # a launcher's, around the check: not this group's
        os.environ.pop(inherited, None)
    torch.set_num_threads(1)
    check = RankCheck(rank, world, chunks, Path(learner), function, events)
    try:
        function = load_function(check.learner, function)  # before the group exists: it cannot talk yet
        # the group meets in ``store`` (a file); comms.init then takes it, with the checker's timeout
        # (its own stall detection comes first)
        limit = datetime.timedelta(seconds=300.0)
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=limit
        )
        comms.init("gloo", timeout=300.0)
        with check.recorder:
            check.run(function, cases)
        comms.shutdown()
    except BaseException as error:
        events.put(("lost", rank, check.case, f"{type(error).__name__}: {error}".splitlines()[0]))
        leave(events, 1)
    leave(events, 0)
