"""Schedules in ``torch.distributed.pipelining``'s CSV format (``compute_only``), both ways.

One row per rank, one cell per action in the rank's order: ``{stage}{op}{microbatch}`` with the global
virtual stage (``0F0``, ``3I1``, ``3W1``, ``2B0``), an empty cell for an idle slot, and
``({a};{b})OVERLAP_F_B`` for an overlapped forward-backward pair. The placement is whatever the file
says: each stage belongs to the rank whose row computes it, and a rank's chunks are its stages in
increasing order. The number of micro-batches is the file's too.

A file that cannot run is refused before any process waits on another: a malformed cell (named by row
and cell), a stage on two ranks, an action missing or repeated, a schedule that would deadlock.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from pipeclock.engine.actions import Action, Schedule, placement_of, validate
from pipeclock.engine.placement import Placement

_CELL = re.compile(r"^(\d+)([FBIW])(\d+)$")
_OVERLAP = re.compile(r"^\((.*);(.*)\)OVERLAP_F_B$")
_EXAMPLE = "e.g. 0F0, 3I1, 3W1, 2B0, an empty cell, or (0F1;3B0)OVERLAP_F_B"


class ScheduleFileError(ValueError):
    """A schedule file that cannot run; the message names the file and, where it can, the row and cell."""


def load_csv(path: str | os.PathLike) -> Schedule:
    """The schedule a CSV file holds, with its placement; ``ScheduleFileError`` if it cannot run."""
    path = Path(path)
    try:
        rows = list(csv.reader(path.read_text().splitlines()))
    except OSError as error:
        raise ScheduleFileError(f"cannot read the schedule file {path}: {error.strerror}") from None
    if not rows:
        raise ScheduleFileError(f"{path}: the schedule file is empty")
    parsed = [_parse_row(path, number, row) for number, row in enumerate(rows)]
    placement = _placement(path, parsed)
    schedule = Schedule(
        [[_local(action, stage, placement) for stage, action in row] for row in parsed], placement
    )
    _check_runs(path, schedule)
    return schedule


def save_csv(schedule: list[list[Action]], path: str | os.PathLike) -> Path:
    """Write ``schedule`` in torch's format (an overlapped pair as one ``OVERLAP_F_B`` cell)."""
    placement, path = placement_of(schedule), Path(path)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        for rank, actions in enumerate(schedule):
            writer.writerow(_cells(rank, actions, placement))
    return path


def _cells(rank: int, actions: list[Action], placement: Placement) -> list[str]:
    def text(action: Action) -> str:
        return f"{placement.stage(rank, action.chunk)}{action.op}{action.microbatch}"

    cells, index = [], 0
    while index < len(actions):
        action = actions[index]
        if action.overlap and index + 1 < len(actions):
            cells.append(f"({text(action)};{text(actions[index + 1])})OVERLAP_F_B")
            index += 2
        else:
            cells.append(text(action))
            index += 1
    return cells


# --- reading ------------------------------------------------------------------------------------------


def _parse_row(path: Path, number: int, row: list[str]) -> list[tuple[int, Action]]:
    """(global stage, action with the chunk still unknown) for every non-empty cell of one row."""
    parsed: list[tuple[int, Action]] = []
    for column, cell in enumerate(row):
        cell = cell.strip()
        if not cell:
            continue
        where = f"{path}: row {number + 1} (rank {number}), cell {column + 1}"
        pair = _OVERLAP.match(cell)
        if pair:
            first, second = (_parse_cell(where, part.strip()) for part in pair.groups())
            if first[1].op != "F" or second[1].op not in ("B", "I"):
                raise ScheduleFileError(f"{where}: {cell!r} must pair a forward with a backward")
            parsed += [(first[0], Action("F", first[1].microbatch, overlap=True)), second]
        else:
            parsed.append(_parse_cell(where, cell))
    return parsed


def _parse_cell(where: str, cell: str) -> tuple[int, Action]:
    match = _CELL.match(cell)
    if not match:
        raise ScheduleFileError(f"{where}: {cell!r} is not an action ({_EXAMPLE})")
    stage, op, microbatch = match.groups()
    return int(stage), Action(op, int(microbatch))  # type: ignore[arg-type]


def _placement(path: Path, parsed: list[list[tuple[int, Action]]]) -> Placement:
    """Each stage on the one rank whose row computes it."""
    owners: dict[int, int] = {}
    for rank, row in enumerate(parsed):
        for stage, _ in row:
            if owners.setdefault(stage, rank) != rank:
                raise ScheduleFileError(
                    f"{path}: stage {stage} is computed by rank {owners[stage]} and by rank {rank}; "
                    "a stage lives on one rank"
                )
    try:
        return Placement(
            tuple(tuple(sorted(s for s, r in owners.items() if r == rank)) for rank in range(len(parsed)))
        )
    except ValueError as error:
        raise ScheduleFileError(f"{path}: {error}") from None


def _local(action: Action, stage: int, placement: Placement) -> Action:
    chunk = placement.owner(stage)[1]
    return Action(action.op, action.microbatch, chunk, overlap=action.overlap)


def _check_runs(path: Path, schedule: Schedule) -> None:
    from pipeclock.observe.simulate import DeadlockError, simulate

    m = 1 + max(a.microbatch for row in schedule for a in row)
    try:
        validate(schedule, len(schedule), m)
        simulate(schedule)
    except (ValueError, DeadlockError) as error:
        raise ScheduleFileError(f"{path}: {error}") from None
