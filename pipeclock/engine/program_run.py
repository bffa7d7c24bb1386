"""A program run with costs: when each rank would run each instruction, a compute waiting for the
messages it needs, a send paying latency and bandwidth. The simulator of ``pipeclock schedule``, the
planner and the decode loop, and the check that a custom schedule can finish (``must_finish``): a
program that cannot is a ``DeadlockError`` naming what each rank waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeclock.engine.actions import Action
from pipeclock.engine.program import DeadlockError, Instruction, Program, lower, message_key


@dataclass
class ProgramTimeline:
    """When each rank ran each instruction: ``spans[rank]`` is (instruction, start, end) in order."""

    spans: list[list[tuple[Instruction, float, float]]]

    @property
    def makespan(self) -> float:
        return max((end for rank in self.spans for _, _, end in rank), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(end - start for instruction, start, end in self.spans[rank] if instruction.is_compute)

    @property
    def bubble(self) -> float:
        """The share of rank-time spent not computing, over the makespan."""
        total = self.makespan * len(self.spans)
        return 1.0 - sum(self.busy(r) for r in range(len(self.spans))) / total if total else 0.0


Cost = Callable[[int, Instruction], float]


def must_finish(schedule: Sequence[Sequence[Action]]) -> None:
    """Raise ``DeadlockError`` if ``schedule``'s program can never finish (compute and messages alike)."""
    simulate_program(lower(schedule), lambda _rank, _instruction: 1.0)


def simulate_program(
    programs: Sequence[Program],
    compute: Cost,
    latency: float = 0.0,
    bandwidth: float | None = None,
    message_bytes: Callable[[Instruction], float] = lambda _: 0.0,
    step_seconds: float = 0.0,
) -> ProgramTimeline:
    """Run ``programs`` on paper: each rank in order, a compute starting once the rank is free and its
    inputs exist (data from another rank once its message arrived; from this rank, once computed). A
    message leaves when both its send and its receive are posted and takes ``latency + bytes /
    bandwidth``; ``AGREE`` and ``LOSS`` each cost ``step_seconds``. Raises ``DeadlockError`` naming
    what each stuck rank waits for if some rank can never go on."""
    run = _ProgramRun(programs, latency, bandwidth, message_bytes)
    moved = True
    while moved:
        moved = False
        for rank in range(len(programs)):
            while run.advance(rank, compute, step_seconds):
                moved = True
    if not run.finished:
        raise DeadlockError(run.deadlock_report())
    return ProgramTimeline(run.spans)


Need = tuple[str, int, int]  # ("F" or "B" or "I", stage, micro-batch): what a compute uses


class _ProgramRun:
    """The state of a simulated program: where each rank is, when it is free, what exists and when."""

    def __init__(self, programs, latency: float, bandwidth: float | None, message_bytes) -> None:
        self.programs, self.latency, self.bandwidth = programs, latency, bandwidth
        self.message_bytes = message_bytes
        self.position = [0] * len(programs)
        self.free_at = [0.0] * len(programs)
        self.posted: dict[Need, float] = {}  # receives posted, by message key
        self.sent: dict[Need, tuple[float, float]] = {}  # sends posted: (time, bytes)
        self.computed: list[dict[Need, float]] = [{} for _ in programs]
        self.spans: list[list[tuple[Instruction, float, float]]] = [[] for _ in programs]
        self.receives = [{message_key(i) for i in p if i.kind in ("RECV_F", "RECV_B")} for p in programs]
        self.backward_stages = {i.stage for p in programs for i in p if i.kind in ("B", "I")}

    @property
    def finished(self) -> bool:
        return all(pos == len(p) for pos, p in zip(self.position, self.programs, strict=True))

    def advance(self, rank: int, compute: Cost, step_seconds: float) -> bool:
        """Run the rank's next instruction if it can start; False if it must wait (or is done)."""
        if self.position[rank] == len(self.programs[rank]):
            return False
        instruction = self.programs[rank][self.position[rank]]
        start = end = self.free_at[rank]
        if instruction.is_compute:
            ready = [self._ready(rank, need) for need in _needs(instruction)]
            if any(time is None for time in ready):
                return False
            start = max([start, *ready])  # type: ignore[list-item]
            end = start + compute(rank, instruction)
            self._computed(rank, instruction, end)
        elif instruction.kind in ("RECV_F", "RECV_B"):
            self.posted[message_key(instruction)] = start
        elif instruction.kind in ("SEND_F", "SEND_B"):
            self.sent[message_key(instruction)] = (start, self.message_bytes(instruction))
        elif instruction.kind in ("AGREE", "LOSS"):
            end = start + step_seconds
        self.spans[rank].append((instruction, start, end))
        self.free_at[rank] = end
        self.position[rank] += 1
        return True

    def _computed(self, rank: int, instruction: Instruction, end: float) -> None:
        stage, mb = instruction.stage, instruction.microbatch
        self.computed[rank][(instruction.kind, stage, mb)] = end  # type: ignore[index]
        if instruction.kind == "I":  # an I gives the input's gradient, as a B does
            self.computed[rank][("B", stage, mb)] = end  # type: ignore[index]

    def _ready(self, rank: int, need: Need) -> float | None:
        """When ``need`` is available on ``rank``: computed here, or arrived by message; None if not yet."""
        if need in self.computed[rank]:
            return self.computed[rank][need]
        kind, stage, mb = need
        if kind == "B" and stage not in self.backward_stages:
            return 0.0  # past the last stage: the loss, computed by the backward itself
        message = ("F", stage + 1, mb) if kind == "F" else ("B", stage - 1, mb)
        if kind == "I" or message not in self.posted or message not in self.sent:
            return None
        leaves, size = self.sent[message]
        transfer = self.latency + (size / self.bandwidth if self.bandwidth else 0.0)
        return max(leaves, self.posted[message]) + transfer

    def deadlock_report(self) -> str:
        owners = {i.stage: r for r, p in enumerate(self.programs) for i in p if i.is_compute}
        lines = ["the schedule deadlocks; no rank can move:"]
        for rank, program in enumerate(self.programs):
            if self.position[rank] == len(program):
                lines.append(f"  rank {rank}: finished")
                continue
            instruction = program[self.position[rank]]
            what = instruction.action if instruction.action is not None else instruction
            number = sum(i.is_compute for i in program[: self.position[rank]])
            missing = [
                _need_text(need, owners.get(need[1], rank))
                for need in _needs(instruction)
                if self._ready(rank, need) is None
            ]
            lines.append(
                f"  rank {rank}: stuck at {what} (action {number}), "
                f"waiting for {' and '.join(missing) or 'nothing'}"
            )
        return "\n".join(lines)


def _needs(instruction: Instruction) -> list[Need]:
    """What a compute uses: the stage's input (``F`` of the stage before), its own forward and the
    gradient from the stage after (a backward), its own ``I`` (a ``W``)."""
    if not instruction.is_compute:
        return []
    stage, mb = instruction.stage, instruction.microbatch
    assert stage is not None and mb is not None
    if instruction.kind == "F":
        return [] if stage == 0 else [("F", stage - 1, mb)]
    if instruction.kind == "W":
        return [("I", stage, mb)]
    return [("F", stage, mb), ("B", stage + 1, mb)]


def _need_text(need: Need, rank: int) -> str:
    """A missing input as a reader wants it: a gradient comes from a B, or from an I."""
    kind, _, mb = need
    return f"B{mb} (or I{mb}) on rank {rank}" if kind == "B" else f"{kind}{mb} on rank {rank}"
