"""The step as a program: a schedule lowered to each rank's ordered list of instructions.

``lower`` adds to a schedule's compute (``F``, ``B``, ``I``, ``W``) what the step exchanges, in torch's
words: ``RECV_F``/``RECV_B`` post a receive (the compute that uses it waits), ``SEND_F``/``SEND_B`` send
right after the compute that made the data, ``REDUCE_GRAD`` sums a stage over replicas; and four words of
its own for what a step does once: ``SIZES``, ``AGREE`` (a bad batch refused on every rank before any
activation leaves), ``SUM_TIED`` and ``LOSS``. Lowering choices (when a receive is posted, where
``AGREE`` goes, two stages on one rank handing over in memory) are visible in the program.
``engine.program_run.simulate_program`` runs the same lists with costs; ``check`` refuses messages that
do not match.
Why, in detail: docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeclock.engine.actions import Action, placement_of
from pipeclock.engine.placement import Placement

COMPUTE = ("F", "B", "I", "W")
MESSAGES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
REPLICAS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
STEP = ("SIZES", "AGREE", "SUM_TIED", "LOSS")
KINDS = COMPUTE + MESSAGES + REPLICAS + STEP
WORDS = {
    "F": "forward of a micro-batch through a stage",
    "B": "the whole backward of a micro-batch through a stage",
    "I": "the input-gradient half of a backward",
    "W": "the weight-gradient half of a backward, after its I",
    "SEND_F": "send a stage's output activation to the next stage",
    "RECV_F": "post the receive of a stage's input activation (F waits for it)",
    "SEND_B": "send the gradient of a stage's input to the previous stage",
    "RECV_B": "post the receive of the gradient of a stage's output (B or I waits for it)",
    "UNSHARD": "gather a stage's sharded parameters (torch's word; FSDP2 does it in its own hooks)",
    "RESHARD": "free a stage's gathered parameters (torch's word; FSDP2 does it in its own hooks)",
    "REDUCE_GRAD": "sum a stage's gradients over the data-parallel replicas",
    "SIZES": "pipeclock: this rank's batch sizes and inputs' shape key leave; the others' are posted",
    "AGREE": "pipeclock: the ends' batch sizes read and checked (a bad batch is refused here, everywhere)",
    "SUM_TIED": "pipeclock: tied weights' gradients summed across the stages that hold a copy",
    "LOSS": "pipeclock: the last stage's loss reaches every rank",
}


@dataclass(frozen=True, slots=True)
class Instruction:
    """One step of one rank's program. ``stage`` is the virtual stage (None for a step-wide word);
    ``peer`` the rank at the other end of a message; ``action`` the compute action (local chunk)."""

    kind: str
    stage: int | None = None
    microbatch: int | None = None
    peer: int | None = None
    action: Action | None = None

    def __str__(self) -> str:
        """torch's cell text: ``2F0``, ``1SEND_F3``, ``0REDUCE_GRAD``; a step-wide word alone."""
        if self.stage is None:
            return self.kind
        return f"{self.stage}{self.kind}" + ("" if self.microbatch is None else str(self.microbatch))

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


Program = list[Instruction]


class ProgramError(ValueError):
    """A program that cannot run: a message without its partner, or one posted twice."""


class DeadlockError(RuntimeError):
    """The schedule (or program) can never finish: every unfinished rank waits for what cannot happen."""


def lower(
    schedule: Sequence[Sequence[Action]],
    *,
    replicas: bool = False,
    ties: bool = False,
    placement: Placement | None = None,
) -> list[Program]:
    """Every rank's program for ``schedule`` (a pure function of the schedule and its options).

    A receive is posted just before the compute that uses it, as torch's own checker (which takes a
    receive to block until its send) requires.
    """
    placement = placement or placement_of(schedule)
    return [
        _lower_rank(rank, list(actions), placement, replicas, ties) for rank, actions in enumerate(schedule)
    ]


def _lower_rank(
    rank: int, actions: list[Action], placement: Placement, replicas: bool, ties: bool
) -> Program:
    holds_first = placement.owner(0)[0] == rank
    program: Program = [Instruction("SIZES")]
    posted: set[Instruction] = set()
    last_backward = _last_backwards(actions)
    groups = _groups(actions)
    forward_at = _first_forwards(actions)

    def post(group: int, computed: int) -> None:
        """Post the receives ``groups[group]`` needs, with ``computed`` actions done so far."""
        for index in groups[group] if group < len(groups) else ():
            receive = _receive_for(rank, actions[index], placement)
            if receive is None or receive in posted:
                continue
            if receive.kind == "RECV_B" and not _forward_done(forward_at, actions[index], computed):
                continue  # the gradient's shape is the output's: posted once the forward ran
            posted.add(receive)
            program.append(receive)

    for number, group in enumerate(groups):
        runs_ahead = number == 0 and holds_first  # stage 0's first forward runs while the sizes travel
        if not runs_ahead:
            post(number, group[0])
        for index in group:
            action = actions[index]
            program.append(Instruction(action.op, placement.stage(rank, action.chunk), action.microbatch,
                                       action=action))  # fmt: skip
        for index in group:  # a pair sends after both halves, as torch's OVERLAP_F_B does
            send = _send_after(rank, actions[index], placement)
            if send is not None:
                program.append(send)
            chunk = actions[index].chunk
            if replicas and last_backward.get(chunk) == index:
                program.append(Instruction("REDUCE_GRAD", placement.stage(rank, chunk)))
    if ties:
        program.append(Instruction("SUM_TIED"))
    program.append(Instruction("LOSS"))
    return place_agree(program, agrees_late(rank, placement, replicas))


def agrees_late(rank: int, placement: Placement, replicas: bool) -> bool:
    """Whether ``rank`` may run its first compute before agreeing on the batch: it holds stage 0, whose
    forward needs no other rank, and not the last stage, and no replica waits on it in a collective."""
    first, last = placement.owner(0)[0], placement.owner(placement.num_virtual - 1)[0]
    return not replicas and rank == first != last


def place_agree(program: Program, late: bool) -> Program:
    """``program`` with its one ``AGREE`` right after ``SIZES``, or (``late``) right after its first
    compute (both halves of a pair), before that compute's sends."""
    out = [i for i in program if i.kind != "AGREE"]
    at = 1
    if late:
        first = next((n for n, i in enumerate(out) if i.is_compute), None)
        if first is not None:
            pair = out[first].action is not None and out[first].action.overlap
            at = first + (2 if pair else 1)
    return [*out[:at], Instruction("AGREE"), *out[at:]]


def add_reduce_grad(program: Program) -> Program:
    """``program`` with a ``REDUCE_GRAD`` after each stage's last backward where it has none, and its
    ``AGREE`` before any compute (a program written for one pipeline, run with replicas)."""
    reduced = {i.stage for i in program if i.kind == "REDUCE_GRAD"}
    last = {i.stage: n for n, i in enumerate(program) if i.kind in ("B", "W")}
    out: Program = []
    for index, instruction in enumerate(program):
        out.append(instruction)
        if instruction.stage not in reduced and last.get(instruction.stage) == index:
            out.append(Instruction("REDUCE_GRAD", instruction.stage))
    return place_agree(out, late=False)


def _groups(actions: list[Action]) -> list[list[int]]:
    """The indices of ``actions`` in the groups that run together: one action, or an overlapped pair."""
    groups: list[list[int]] = []
    index = 0
    while index < len(actions):
        size = 2 if actions[index].overlap and index + 1 < len(actions) else 1
        groups.append(list(range(index, index + size)))
        index += size
    return groups


def _first_forwards(actions: list[Action]) -> dict[tuple[int, int], int]:
    """Where each (micro-batch, chunk)'s forward first appears in ``actions``."""
    first: dict[tuple[int, int], int] = {}
    for index, action in enumerate(actions):
        if action.op == "F":
            first.setdefault((action.microbatch, action.chunk), index)
    return first


def _forward_done(forward_at: dict[tuple[int, int], int], action: Action, computed: int) -> bool:
    """Whether ``action``'s forward is among the first ``computed`` actions."""
    return forward_at.get((action.microbatch, action.chunk), computed) < computed


def _last_backwards(actions: list[Action]) -> dict[int, int]:
    """For each chunk, the index of the action that completes its gradients (its last B or W)."""
    return {a.chunk: i for i, a in enumerate(actions) if a.op in ("B", "W")}


def _receive_for(rank: int, action: Action, placement: Placement) -> Instruction | None:
    stage = placement.stage(rank, action.chunk)
    if action.op == "F" and stage > 0:
        sender = placement.owner(stage - 1)[0]
        return None if sender == rank else Instruction("RECV_F", stage, action.microbatch, sender)
    if action.op in ("B", "I") and stage < placement.num_virtual - 1:
        sender = placement.owner(stage + 1)[0]
        return None if sender == rank else Instruction("RECV_B", stage, action.microbatch, sender)
    return None


def _send_after(rank: int, action: Action, placement: Placement) -> Instruction | None:
    stage = placement.stage(rank, action.chunk)
    if action.op == "F" and stage < placement.num_virtual - 1:
        receiver = placement.owner(stage + 1)[0]
        return None if receiver == rank else Instruction("SEND_F", stage, action.microbatch, receiver)
    if action.op in ("B", "I") and stage > 0:
        receiver = placement.owner(stage - 1)[0]
        return None if receiver == rank else Instruction("SEND_B", stage, action.microbatch, receiver)
    return None


# --- checking ------------------------------------------------------------------------------------


def message_key(instruction: Instruction) -> tuple[str, int, int]:
    """What pairs a send with its receive: (direction, receiving stage, micro-batch)."""
    assert instruction.stage is not None and instruction.microbatch is not None
    if instruction.kind == "SEND_F":
        return "F", instruction.stage + 1, instruction.microbatch
    if instruction.kind == "SEND_B":
        return "B", instruction.stage - 1, instruction.microbatch
    return instruction.kind[-1], instruction.stage, instruction.microbatch


def check(programs: Sequence[Program]) -> None:
    """Raise ``ProgramError`` unless every send has exactly one receive and the reverse, between the
    ranks that hold the two stages, and every remote input is posted before the compute that uses it."""
    sends: dict[tuple[str, int, int], tuple[int, Instruction]] = {}
    receives: dict[tuple[str, int, int], tuple[int, Instruction]] = {}
    for rank, program in enumerate(programs):
        for instruction in program:
            if instruction.kind not in MESSAGES:
                continue
            table = sends if instruction.kind.startswith("SEND") else receives
            key = message_key(instruction)
            if key in table:
                raise ProgramError(f"rank {rank}: {instruction} appears twice (also on rank {table[key][0]})")
            table[key] = (rank, instruction)
    for key, (rank, instruction) in sends.items():
        if key not in receives:
            raise ProgramError(
                f"rank {rank}: {instruction} has no matching receive on rank {instruction.peer}"
            )
        receiver, receive = receives[key]
        if receiver != instruction.peer or receive.peer != rank:
            raise ProgramError(f"rank {rank}: {instruction} goes to rank {instruction.peer}, but {receive} "
                               f"is on rank {receiver} and expects rank {receive.peer}")  # fmt: skip
    for key, (rank, instruction) in receives.items():
        if key not in sends:
            raise ProgramError(f"rank {rank}: {instruction} has no matching send on rank {instruction.peer}")


def on_ranks(programs: Sequence[Program], ranks: Sequence[int]) -> list[Program]:
    """A pipeline's programs as global rank ``ranks[r]`` runs program ``r``: each message's peer becomes
    that global rank. Within a mesh every (replica, tp rank) runs its own copy of the one pipeline's
    programs over its own ranks, so tp rank t of stage s exchanges with tp rank t of stages s +- 1."""
    return [
        [i if i.peer is None else replace(i, peer=ranks[i.peer]) for i in program] for program in programs
    ]


def with_peer(instruction: Instruction) -> str:
    """An instruction's cell text with the rank at the message's other end: ``1SEND_F0->3``,
    ``1RECV_F0<-1``; any other instruction as ``str`` gives it."""
    if instruction.kind not in MESSAGES or instruction.peer is None:
        return str(instruction)
    arrow = "->" if instruction.kind.startswith("SEND") else "<-"
    return f"{instruction}{arrow}{instruction.peer}"


def describe(
    programs: Sequence[Program], rank: int | None = None, *, names: Sequence[str] | None = None
) -> str:
    """One line per rank: ``rank 1: SIZES 1RECV_F0 1F0 1SEND_F0 ...`` (all ranks, or one). With ``names``
    (each program's rank as it should be read, e.g. ``rank 5 (dp 0, pp 1, tp 1)``) each message also
    names its peer (``with_peer``)."""
    ranks = range(len(programs)) if rank is None else [rank]
    if names is None:
        return "\n".join(f"rank {r}: " + " ".join(map(str, programs[r])) for r in ranks)
    return "\n".join(f"{names[r]}: " + " ".join(map(with_peer, programs[r])) for r in ranks)
