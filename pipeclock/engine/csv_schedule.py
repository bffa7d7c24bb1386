"""Schedules in ``torch.distributed.pipelining``'s CSV formats, both ways.

One row per rank, one cell per action in the rank's order: ``{stage}{op}{microbatch}`` with the global
virtual stage (``0F0``, ``3I1``, ``3W1``, ``2B0``), an empty cell for an idle slot, and
``({a};{b})OVERLAP_F_B`` for an overlapped forward-backward pair. The placement is whatever the file
says: each stage belongs to the rank whose row computes it, and a rank's chunks are its stages in
increasing order. The number of micro-batches is the file's too.

``compute_only`` holds the compute actions; pipeclock lowers them to a program. ``compute_comms`` holds
the program itself (``1SEND_F0``, ``2RECV_B3``, ``0REDUCE_GRAD``, ...: ``pipeclock.engine.program``)
and runs as written; the step-wide words of pipeclock's own (``SIZES``, ``AGREE``, ``SUM_TIED``,
``LOSS``) are not written, and are added around a program read. ``load_csv`` tells the two apart by
their cells.

A file that cannot run is refused before any process waits on another: a malformed cell (named by row
and cell), a stage on two ranks, an action missing or repeated, a message without its partner, a
schedule or program that would deadlock.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from pipeclock.engine import program as programs
from pipeclock.engine.actions import Action, Schedule, placement_of, validate
from pipeclock.engine.placement import Placement
from pipeclock.engine.program import Instruction
from pipeclock.engine.program_run import must_finish, simulate_program

_CELL = re.compile(r"^(\d+)([FBIW])(\d+)$")
_COMM_CELL = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")
FORMATS = ("compute_only", "compute_comms")
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
    comm_cells = [[_COMM_CELL.match(cell.strip()) for cell in row] for row in rows]
    stripped = [
        ["" if comm else cell for cell, comm in zip(row, comms, strict=True)]
        for row, comms in zip(rows, comm_cells, strict=True)
    ]
    parsed = [_parse_row(path, number, row) for number, row in enumerate(stripped)]
    placement = _placement(path, parsed)
    schedule = Schedule(
        [[_local(action, stage, placement) for stage, action in row] for row in parsed], placement
    )
    _check_runs(path, schedule)
    if any(match for row in comm_cells for match in row):
        schedule.programs = _read_programs(path, rows, comm_cells, schedule)
    return schedule


def save_csv(schedule: list[list[Action]], path: str | os.PathLike, format: str = "compute_only") -> Path:
    """Write ``schedule`` in torch's ``compute_only`` format (an overlapped pair as one ``OVERLAP_F_B``
    cell), or, with ``format="compute_comms"``, the program pipeclock lowers it to."""
    if format not in FORMATS:
        raise ValueError(f"unknown CSV format {format!r}: use {' or '.join(FORMATS)}")
    placement, path = placement_of(schedule), Path(path)
    rows = [_cells(rank, actions, placement) for rank, actions in enumerate(schedule)]
    if format == "compute_comms":
        lowered = getattr(schedule, "programs", None) or programs.lower(schedule)
        rows = [_program_cells(program, actions) for program, actions in zip(lowered, schedule, strict=True)]
    with open(path, "w", newline="") as file:
        csv.writer(file).writerows(rows)
    return path


def _program_cells(program: programs.Program, actions: list[Action]) -> list[str]:
    """A program's cells: its compute as in ``compute_only``, its messages in torch's words."""
    cells: list[str] = []
    pending: str | None = None  # an overlapped pair's forward, waiting for its backward
    for instruction in program:
        if instruction.stage is None:
            continue  # pipeclock's own step-wide words: added back when read
        text = str(instruction)
        if instruction.action is not None and instruction.action.overlap:
            pending = text
        elif pending is not None and instruction.is_compute:
            cells.append(f"({pending};{text})OVERLAP_F_B")
            pending = None
        else:
            cells.append(text)
    return cells


def _read_programs(
    path: Path, rows: list[list[str]], comm_cells, schedule: Schedule
) -> list[programs.Program]:
    """The programs of a ``compute_comms`` file, checked: messages matched, nothing waits for ever."""
    placement = placement_of(schedule)
    read: list[programs.Program] = []
    for rank, (row, comms) in enumerate(zip(rows, comm_cells, strict=True)):
        actions = iter(schedule[rank])
        program = [Instruction("SIZES")]
        for column, (cell, comm) in enumerate(zip(row, comms, strict=True)):
            if comm:
                program.append(_comm_instruction(path, rank, column, comm, placement))
            elif cell.strip():
                for _ in range(2 if _OVERLAP.match(cell.strip()) else 1):
                    action = next(actions)
                    stage = placement.stage(rank, action.chunk)
                    program.append(Instruction(action.op, stage, action.microbatch, action=action))
        late = programs.agrees_late(rank, placement, replicas=False)
        read.append(programs.place_agree([*program, Instruction("SUM_TIED"), Instruction("LOSS")], late))
    try:
        programs.check(read)
        simulate_program(read, lambda _rank, _instruction: 1.0)
    except (programs.ProgramError, programs.DeadlockError) as error:
        raise ScheduleFileError(f"{path}: {error}") from None
    return read


def _comm_instruction(
    path: Path, rank: int, column: int, match: re.Match, placement: Placement
) -> Instruction:
    stage, kind, microbatch = int(match.group(1)), match.group(2), match.group(3)
    where = f"{path}: row {rank + 1} (rank {rank}), cell {column + 1}"
    if stage >= placement.num_virtual:
        raise ScheduleFileError(
            f"{where}: {match.group(0)} names stage {stage}; the file has {placement.num_virtual}"
        )
    if kind in programs.MESSAGES:
        if not microbatch:
            raise ScheduleFileError(f"{where}: {match.group(0)} needs a micro-batch (e.g. {stage}{kind}0)")
        peer_stage = {"SEND_F": stage + 1, "RECV_F": stage - 1, "SEND_B": stage - 1, "RECV_B": stage + 1}[
            kind
        ]
        if not 0 <= peer_stage < placement.num_virtual:
            raise ScheduleFileError(f"{where}: {match.group(0)} has no stage {peer_stage} at its other end")
        if placement.owner(stage)[0] != rank:
            raise ScheduleFileError(
                f"{where}: {match.group(0)} is for stage {stage}, which rank {rank} does not hold"
            )
        peer = placement.owner(peer_stage)[0]
        if peer == rank:
            raise ScheduleFileError(
                f"{where}: {match.group(0)}: stages {stage} and {peer_stage} are both on rank {rank}, "
                "which hands over in memory: remove the cell"
            )
        return Instruction(kind, stage, int(microbatch), peer)
    return Instruction(kind, stage)


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
    m = 1 + max(a.microbatch for row in schedule for a in row)
    try:
        validate(schedule, len(schedule), m)
        must_finish(schedule)
    except (ValueError, programs.DeadlockError) as error:
        raise ScheduleFileError(f"{path}: {error}") from None
