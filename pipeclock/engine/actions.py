"""The Action IR: what a rank computes, and what each computation waits for.

A schedule is, for each rank, an ordered list of `Action`s. Everything else is derived from those lists
and from the three dependency rules below, which live here once so that the simulator (a predicted
timeline) and the orchestrator (a real run) cannot disagree about them:

- ``F`` of virtual stage s needs the activation from ``F`` of stage s - 1 (none for stage 0);
- ``B`` of stage s needs the gradient from ``B`` of stage s + 1 (the loss for the last stage) and its own
  stage's ``F``;
- ``W`` of stage s needs its own stage's ``B``.

Rank r's local chunk c is virtual stage ``c * num_stages + r``: chunks are dealt round-robin, so with
several chunks per rank an activation travels rank 0, 1, ..., p-1, 0, 1, ... (Megatron's interleaving).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Literal

Op = Literal["F", "B", "W"]
OPS: tuple[str, ...] = ("F", "B", "W")
Schedule = list[list["Action"]]

_ACTION_TEXT = re.compile(r"^([FBW])(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One compute step of one rank: ``op`` on ``microbatch`` through the rank's local ``chunk``.

    ``op`` is ``"F"`` (forward), ``"B"`` (backward; in split schedules only the input-gradient half) or
    ``"W"`` (weight gradient, split schedules only).
    """

    op: Op
    microbatch: int
    chunk: int = 0

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
        """The inverse of ``str``: ``"F3"`` -> ``Action("F", 3)``, ``"B2.1"`` -> ``Action("B", 2, 1)``."""
        match = _ACTION_TEXT.match(text.strip())
        if not match:
            raise ValueError(f"not an action: {text!r} (expected e.g. F3, B3, W3 or F3.1)")
        op, microbatch, chunk = match.groups()
        return cls(op, int(microbatch), int(chunk or 0))  # type: ignore[arg-type]


def parse_schedule(rows: list[str]) -> Schedule:
    """Build a schedule from one whitespace-separated row of actions per rank (handy in tests and docs)."""
    return [[Action.parse(word) for word in row.split()] for row in rows]


def virtual_stage(rank: int, chunk: int, num_stages: int) -> int:
    """The pipeline position of rank ``rank``'s local ``chunk``."""
    return chunk * num_stages + rank


def owner(stage: int, num_stages: int) -> tuple[int, int]:
    """The (rank, local chunk) that runs virtual stage ``stage``."""
    return stage % num_stages, stage // num_stages


def num_chunks(schedule: Schedule) -> int:
    """How many model chunks each rank holds in ``schedule`` (1 unless it interleaves)."""
    return 1 + max((a.chunk for actions in schedule for a in actions), default=0)


def is_split(schedule: Schedule) -> bool:
    """True when backward is split into B (input gradient) and W (weight gradient)."""
    return any(a.op == "W" for actions in schedule for a in actions)


def dependencies(action: Action, rank: int, num_stages: int, num_virtual: int) -> list[tuple[int, Action]]:
    """The (rank, action) pairs that must finish before ``action`` on ``rank`` can start.

    ``num_virtual`` is the number of virtual stages (chunks x ranks). This is the single statement of the
    data flow; the order of a rank's own list adds the remaining (program-order) constraints.
    """
    stage = virtual_stage(rank, action.chunk, num_stages)
    needs: list[tuple[int, Action]] = []
    if action.op == "F" and stage > 0:
        needs.append(_at(stage - 1, "F", action.microbatch, num_stages))
    elif action.op == "B":
        needs.append((rank, Action("F", action.microbatch, action.chunk)))
        if stage < num_virtual - 1:
            needs.append(_at(stage + 1, "B", action.microbatch, num_stages))
    elif action.op == "W":
        needs.append((rank, Action("B", action.microbatch, action.chunk)))
    return needs


def _at(stage: int, op: Op, microbatch: int, num_stages: int) -> tuple[int, Action]:
    rank, chunk = owner(stage, num_stages)
    return rank, Action(op, microbatch, chunk)


def validate(schedule: Schedule, num_stages: int, num_microbatches: int, chunks: int = 1) -> None:
    """Raise ``ValueError`` unless ``schedule`` computes each (virtual stage, micro-batch) exactly once.

    Exactly one F and one B for every micro-batch on every virtual stage, and one W as well when the
    schedule is split; no action outside the ranges. Deadlock freedom is the simulator's job.
    """
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} ranks, expected {num_stages}")
    split = is_split(schedule)
    expected_ops = OPS if split else ("F", "B")
    for rank, actions in enumerate(schedule):
        counts = Counter(actions)
        problems = [f"{a} appears {n} times" for a, n in counts.items() if n > 1]
        problems += [
            f"{a} is out of range"
            for a in counts
            if a.microbatch >= num_microbatches or a.chunk >= chunks or a.op not in expected_ops
        ]
        missing = [
            Action(op, mb, c)  # type: ignore[arg-type]
            for c in range(chunks)
            for mb in range(num_microbatches)
            for op in expected_ops
            if Action(op, mb, c) not in counts  # type: ignore[arg-type]
        ]
        if missing:
            problems.append(
                "missing " + " ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            )
        if problems:
            raise ValueError(f"invalid schedule on rank {rank}: " + "; ".join(problems))
