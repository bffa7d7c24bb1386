"""The Action IR: what a rank computes, and what each computation waits for.

A schedule is, for each rank, an ordered list of `Action`s, and a placement (``pipeclock.engine
.placement``): which rank runs which virtual stage. Everything else is derived from those and from the
dependency rules below, which live here once so that the simulator (a predicted timeline) and the
orchestrator (a real run) cannot disagree about them:

- ``F`` of virtual stage s needs the activation from ``F`` of stage s - 1 (none for stage 0);
- the backward of stage s, ``B`` (input and weight gradients at once) or ``I`` (the input gradient
  only), needs its own stage's ``F`` and the gradient from the backward (``B`` or ``I``) of stage s + 1
  (the loss, for the last stage);
- ``W`` (the weight gradient) of stage s needs its own stage's ``I``.

Each (stage, micro-batch) has one ``F`` and either one ``B``, or one ``I`` and one ``W``; a schedule may
mix the two kinds (DualPipeV does).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from pipeclock.engine.placement import Placement

Op = Literal["F", "B", "I", "W"]
OPS: tuple[str, ...] = ("F", "B", "I", "W")
BACKWARDS: tuple[str, ...] = ("B", "I")

_ACTION_TEXT = re.compile(r"^([FBIW])(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One compute step of one rank: ``op`` on ``microbatch`` through the rank's local ``chunk``.

    ``op`` is ``"F"`` (forward), ``"B"`` (the whole backward), ``"I"`` (the backward's input-gradient
    half) or ``"W"`` (the weight-gradient half, after an ``I``). ``chunk`` is the rank's local chunk:
    the placement says which virtual stage it is.

    ``overlap`` marks an ``F`` that forms an overlapped pair with the rank's next action, a backward
    (DualPipe's F&B): the pair starts when both have their inputs. A CPU runs the two one after the
    other; the mark is part of the schedule, not of the action's identity (equality ignores it).
    """

    op: Op
    microbatch: int
    chunk: int = 0
    overlap: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Action op must be one of {OPS}, got {self.op!r}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(
                f"Action micro-batch and chunk must be >= 0, got {self.microbatch}, {self.chunk}"
            )

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> Action:
        """The inverse of ``str``: ``"F3"`` -> ``Action("F", 3)``, ``"I2.1"`` -> ``Action("I", 2, 1)``."""
        match = _ACTION_TEXT.match(text.strip())
        if not match:
            raise ValueError(f"not an action: {text!r} (expected e.g. F3, B3, I3, W3 or F3.1)")
        op, microbatch, chunk = match.groups()
        return cls(op, int(microbatch), int(chunk or 0))  # type: ignore[arg-type]


class Schedule(list):
    """Every rank's actions (``schedule[r]``), and the ``placement`` of the virtual stages on the ranks.

    A plain list of lists is a schedule too: its placement is the loop (``placement_of``).
    """

    def __init__(self, rows=(), placement: Placement | None = None):
        super().__init__(rows)
        self.placement = placement


def placement_of(schedule: list[list[Action]]) -> Placement:
    """The schedule's own placement, or the loop placement for its ranks and chunks."""
    placement = getattr(schedule, "placement", None)
    return placement or Placement.loop(len(schedule), num_chunks(schedule))


def parse_schedule(rows: list[str], placement: Placement | None = None) -> Schedule:
    """Build a schedule from one whitespace-separated row of actions per rank (handy in tests and docs)."""
    return Schedule([[Action.parse(word) for word in row.split()] for row in rows], placement)


def num_chunks(schedule: list[list[Action]]) -> int:
    """How many model chunks each rank holds in ``schedule`` (1 unless it interleaves or is a V)."""
    placement = getattr(schedule, "placement", None)
    if placement is not None:
        return placement.chunks
    return 1 + max((a.chunk for actions in schedule for a in actions), default=0)


def is_split(schedule: list[list[Action]]) -> bool:
    """True when some backward is split into I (input gradient) and W (weight gradient)."""
    return any(a.op == "W" for actions in schedule for a in actions)


def join_first_stage_backwards(schedule: list[list[Action]]) -> Schedule:
    """``schedule`` with each ``I`` of virtual stage 0 that its own ``W`` follows at once written as a ``B``.

    A backward is split so that the previous stage gets its gradient before the weights' half is done.
    Stage 0 has no previous stage: when its W comes next anyway, splitting only adds work (two passes
    where one would do) and holds what W needs in between. In ZB-H1 every first-stage I is followed by its
    W. The engine runs the joined table, and the planner counts memory on it.
    """
    placement = placement_of(schedule)
    rows = []
    for rank, actions in enumerate(schedule):
        row: list[Action] = []
        for action in actions:
            joins = (
                action.op == "W"
                and placement.stage(rank, action.chunk) == 0
                and bool(row)
                and row[-1] == Action("I", action.microbatch, action.chunk)
            )
            if joins:
                row[-1] = Action("B", action.microbatch, action.chunk)
            else:
                row.append(action)
        rows.append(row)
    return Schedule(rows, getattr(schedule, "placement", None))


def forward_only(schedule: list[list[Action]]) -> Schedule:
    """Every rank's forwards of ``schedule`` in (micro-batch, virtual stage) order, with its placement:
    what an evaluation runs.

    The forwards are plain actions: an ``overlap`` mark pairs a forward with the backward after it,
    and without backwards it would pair two forwards instead, the second of which may need what the
    other rank sends only after the first (a deadlock in a V, where both stages of a rank lie on
    every micro-batch's path).
    """
    placement = placement_of(schedule)
    rows = [
        sorted(
            (Action("F", a.microbatch, a.chunk) for a in actions if a.op == "F"),
            key=lambda a, rank=rank: (a.microbatch, placement.stage(rank, a.chunk)),
        )
        for rank, actions in enumerate(schedule)
    ]
    return Schedule(rows, getattr(schedule, "placement", None))


def gradient_ready(microbatch: int, chunk: int) -> Action:
    """The event "the gradient of this chunk's input exists": what a ``B`` or an ``I`` produces."""
    return Action("B", microbatch, chunk)


def produces(action: Action) -> tuple[Action, ...]:
    """The events ``action`` completes: itself, and for an ``I`` also the gradient a ``B`` would give."""
    if action.op == "I":
        return action, gradient_ready(action.microbatch, action.chunk)
    return (action,)


def dependencies(action: Action, rank: int, placement: Placement) -> list[tuple[int, Action]]:
    """The (rank, event) pairs that must have happened before ``action`` on ``rank`` can start.

    Events are what ``produces`` lists. This is the single statement of the data flow; the order of a
    rank's own list adds the remaining (program-order) constraints.
    """
    stage = placement.stage(rank, action.chunk)
    needs: list[tuple[int, Action]] = []
    if action.op == "F" and stage > 0:
        before, chunk = placement.owner(stage - 1)
        needs.append((before, Action("F", action.microbatch, chunk)))
    elif action.op in BACKWARDS:
        needs.append((rank, Action("F", action.microbatch, action.chunk)))
        if stage < placement.num_virtual - 1:
            after, chunk = placement.owner(stage + 1)
            needs.append((after, gradient_ready(action.microbatch, chunk)))
    elif action.op == "W":
        needs.append((rank, Action("I", action.microbatch, action.chunk)))
    return needs


def validate(
    schedule: list[list[Action]], num_stages: int, num_microbatches: int, chunks: int | None = None
) -> None:
    """Raise ``ValueError`` unless ``schedule`` computes each (virtual stage, micro-batch) exactly once.

    On every rank and chunk: one F per micro-batch, and either one B, or one I and one W; no action
    outside the ranges. Deadlock freedom is the simulator's job.
    """
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} ranks, expected {num_stages}")
    placement = placement_of(schedule)
    if chunks is not None and getattr(schedule, "placement", None) is None and num_chunks(schedule) > chunks:
        raise ValueError(f"schedule uses {num_chunks(schedule)} chunks per rank, expected {chunks}")
    for rank, actions in enumerate(schedule):
        problems = _problems(actions, len(placement.stages[rank]), num_microbatches)
        if problems:
            raise ValueError(f"invalid schedule on rank {rank}: " + "; ".join(problems))


def _problems(actions: list[Action], chunks: int, num_microbatches: int) -> list[str]:
    counts = Counter(actions)
    problems = [f"{a} appears {n} times" for a, n in counts.items() if n > 1]
    problems += [
        f"{a} is out of range" for a in counts if a.microbatch >= num_microbatches or a.chunk >= chunks
    ]
    missing = []
    for chunk in range(chunks):
        for mb in range(num_microbatches):
            has = {op: Action(op, mb, chunk) in counts for op in OPS}  # type: ignore[arg-type]
            if not has["F"]:
                missing.append(Action("F", mb, chunk))
            if has["B"] and has["I"]:
                problems.append(f"{Action('B', mb, chunk)} and {Action('I', mb, chunk)} both appear")
            elif not (has["B"] or has["I"]):
                missing.append(Action("B", mb, chunk))
            if has["I"] and not has["W"]:
                missing.append(Action("W", mb, chunk))
            if has["W"] and not has["I"]:
                problems.append(
                    f"{Action('W', mb, chunk)} has no I before it (a B computes the weights itself)"
                )
    if missing:
        problems.append("missing " + " ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else ""))
    return problems
