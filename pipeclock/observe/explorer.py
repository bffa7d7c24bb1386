"""The explorer: one self-contained HTML page to play with the schedules (``python -m pipeclock explore``).

The page carries pipeclock's own schedules as data, every generator on a grid of stages, micro-batches
and times them in JavaScript by the simulator's rules (`pipeclock.observe.simulate`, the rules of the
program the engine runs: a rank runs its list in order and posts an action's receives when it reaches
it; an action starts when the rank is free and its inputs, per `pipeclock.engine.actions.dependencies`,
are there, a message leaving once both its ends are posted and taking the message cost). Its figures
are read as `pipeclock.observe.timeline.Timeline` reads them; where a bubble formula assumes what the
sizes do not give (ZB-V with m < 2p), the case says so, and the page puts that beside the formula.
Nothing is fetched: style, script and data are inline, so the page works from a file, offline.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from pipeclock.engine.actions import Action, Schedule, placement_of
from pipeclock.engine.generators import (
    SCHEDULES,
    bubble_formula_text,
    chunks_of,
    formula_assumption,
    generate,
    supports_chunks,
)

PAGE_FILES = Path(__file__).resolve().parent / "explorer_page"


@dataclass(frozen=True)
class Grid:
    """The sizes the page holds: p in 1..stages, m in 1..microbatches, 1..chunks for interleaving."""

    stages: int = 8
    microbatches: int = 16
    chunks: int = 4


def action_token(action: Action, digits: int, chunked: bool) -> str:
    """An action in a few letters: its op (``f`` for an F overlapped with the backward after it, as in
    DualPipeV's F&B), its micro-batch in base 36 on ``digits`` letters, and its chunk if ``chunked``."""
    op = "f" if action.overlap else action.op
    return op + _base36(action.microbatch).rjust(digits, "0") + (_base36(action.chunk) if chunked else "")


def schedule_case(schedule: Schedule) -> dict:
    """One schedule as the page reads it: each rank's stages (its chunks, in order) and its actions.

    A row is its actions' tokens run together (`action_token`): every micro-batch takes as many letters
    as the largest one, and a chunk one letter where some rank holds more than one.
    """
    stages = placement_of(schedule).stages
    largest = max(action.microbatch for row in schedule for action in row)
    digits, chunked = len(_base36(largest)), max(map(len, stages)) > 1
    return {
        "stages": [list(held) for held in stages],
        "rows": ["".join(action_token(action, digits, chunked) for action in row) for row in schedule],
    }


def _base36(value: int) -> str:
    letters = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        value, digit = divmod(value, 36)
        text = letters[digit] + text
        if not value:
            return text


def _chunk_choices(name: str, grid: Grid) -> range:
    fixed = chunks_of(name)
    if fixed is not None:
        return range(fixed, fixed + 1)
    return range(1, grid.chunks + 1) if supports_chunks(SCHEDULES[name]) else range(1, 2)


def schedule_data(grid: Grid = Grid()) -> dict:
    """Every schedule on ``grid``, keyed ``name/p/m/chunks``; a size a generator refuses keeps its error."""
    cases: dict[str, dict] = {}
    for name in SCHEDULES:
        for chunks in _chunk_choices(name, grid):
            for p in range(1, grid.stages + 1):
                for m in range(1, grid.microbatches + 1):
                    try:
                        case = schedule_case(generate(name, p, m, chunks))
                        assumed = formula_assumption(name, p, m, chunks)
                        cases[f"{name}/{p}/{m}/{chunks}"] = case | ({"caveat": assumed} if assumed else {})
                    except ValueError as refused:
                        cases[f"{name}/{p}/{m}/{chunks}"] = {"error": str(refused)}
    schedules = {
        name: {
            "formula": bubble_formula_text(name),
            "chunks": chunks_of(name),
            "interleaves": supports_chunks(SCHEDULES[name]),
        }
        for name in SCHEDULES
    }
    grid_sizes = {"stages": grid.stages, "microbatches": grid.microbatches, "chunks": grid.chunks}
    return {"grid": grid_sizes, "schedules": schedules, "cases": cases}


@functools.cache
def page(grid: Grid = Grid()) -> str:
    """The whole page, as one HTML text (made once: the grid's schedules take a second to generate)."""
    data = json.dumps(schedule_data(grid), separators=(",", ":")).replace("</", "<\\/")
    parts = {
        "/*EXPLORER_STYLE*/": (PAGE_FILES / "explorer.css").read_text(),
        "/*EXPLORER_SCRIPT*/": (PAGE_FILES / "explorer.js").read_text(),
        "/*EXPLORER_DATA*/": data,
    }
    html = (PAGE_FILES / "page.html").read_text()
    for marker, text in parts.items():
        html = html.replace(marker, text)
    return html


def write_page(path: str | Path, grid: Grid = Grid()) -> Path:
    """Write the page to ``path`` (its folder made if needed); the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(grid), encoding="utf-8")
    return path
