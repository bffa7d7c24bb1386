"""The course pages' tables of simulated schedules, made from the simulator so they never go stale.

A page holds one between ``<!-- generated: KIND key=value ... -->`` and ``<!-- end generated -->``;
``python -m pipeclock docs`` rewrites it with `refresh_generated`, and the docs test checks that the
page already says what the simulator gives today. KIND is a key of `GENERATED`; the key=value pairs are
its integer arguments.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pipeclock.engine.generators import (
    SCHEDULES,
    bubble_formula,
    bubble_formula_text,
    chunks_of,
    generate,
    get_schedule,
)
from pipeclock.engine.generators import supports_chunks as _interleaves
from pipeclock.observe.report import messages_per_rank
from pipeclock.observe.simulate import default_costs, simulate

_GENERATED = re.compile(r"^<!-- generated: (\S+)((?: \w+=\w+)*) -->$")
_GENERATED_END = "<!-- end generated -->"


class TableError(ValueError):
    """A generated table the pages ask for that cannot be made (unknown kind, missing end marker)."""


def _percent(value: float) -> str:
    return f"{value:.1%}"


def _number(value: float) -> str:
    return f"{value:.4g}"


def _listed(values) -> str:
    return " ".join(_number(value) for value in values)


def _simulated(name: str, p: int, m: int, v: int):
    """The schedule and its simulated step with the textbook costs (F = 1, B = 2, and I = W = 1 for a
    split backward); a chunk costs 1/v of a stage, as in ``pipeclock schedule``."""
    schedule = generate(name, p, m, v)
    costs = {op: cost / v for op, cost in default_costs(schedule).items()}
    return schedule, simulate(schedule, costs)


def _label(name: str, chunks: int) -> str:
    """``zb-v`` (V), ``interleaved-1f1b`` (v=2), or the bare name."""
    if chunks_of(name):
        return f"`{name}` (V)"
    return f"`{name}` (v={chunks})" if chunks > 1 else f"`{name}`"


def _chunks_for(name: str, v: int) -> int:
    return chunks_of(name) or (v if _interleaves(get_schedule(name)) else 1)


def tradeoffs_table(p: int, m: int, v: int) -> list[str]:
    """Every schedule at (p, m): bubble, step length, activations held and messages, per rank."""
    lines = [
        "| schedule | bubble (simulated) | formula | step (in stage forwards) | micro-batches held at the "
        "peak, per rank | messages per step, per rank | actions per step, per rank |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in SCHEDULES:
        chunks = _chunks_for(name, v)
        schedule, timeline = _simulated(name, p, m, chunks)
        label = _label(name, chunks)
        formula = f"{_percent(bubble_formula(name, p, m, chunks))} = {bubble_formula_text(name)}"
        cells = [
            label,
            _percent(timeline.bubble_share),
            formula,
            _number(timeline.makespan),
            _listed(timeline.peak_live(rank) for rank in range(p)),
            _listed(messages_per_rank(schedule)),
            _listed(len(actions) for actions in schedule),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def bubble_by_m_table(p: int, v: int, ms: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> list[str]:
    """The simulated bubble of every schedule for several numbers of micro-batches."""
    lines = ["| schedule | " + " | ".join(f"m={m}" for m in ms) + " |", "| --- |" + " --- |" * len(ms)]
    for name in SCHEDULES:
        chunks = _chunks_for(name, v)
        label = _label(name, chunks)
        cells = [_percent(_simulated(name, p, m, chunks)[1].bubble_share) for m in ms]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def chunks_table(p: int, m: int, vs: tuple[int, ...] = (1, 2, 4)) -> list[str]:
    """Interleaved 1F1B with more and more chunks per rank: what shrinks and what grows."""
    lines = [
        "| chunks per rank | bubble (simulated) | formula | micro-batches held at the peak, rank 0 "
        "| messages per step, rank 0 | actions per step, rank 0 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for v in vs:
        schedule, timeline = _simulated("interleaved-1f1b", p, m, v)
        formula = f"{_percent(bubble_formula('interleaved-1f1b', p, m, v))}"
        cells = [
            f"v={v}",
            _percent(timeline.bubble_share),
            formula,
            _number(timeline.peak_live(0)),
            str(messages_per_rank(schedule)[0]),
            str(len(schedule[0])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


GENERATED: dict[str, Callable[..., list[str]]] = {
    "tradeoffs": tradeoffs_table,
    "bubble-by-m": bubble_by_m_table,
    "chunks": chunks_table,
}


def refresh_generated(text: str) -> str:
    """``text`` with every generated table rewritten from the simulator."""
    lines, out, index = text.splitlines(), [], 0
    while index < len(lines):
        out.append(lines[index])
        marker = _GENERATED.match(lines[index].strip())
        index += 1
        if not marker:
            continue
        kind, params = marker.group(1), dict(pair.split("=") for pair in marker.group(2).split())
        if kind not in GENERATED:
            raise TableError(f"unknown generated table {kind!r}; known: {', '.join(GENERATED)}")
        out += GENERATED[kind](**{key: int(value) for key, value in params.items()})
        while index < len(lines) and lines[index].strip() != _GENERATED_END:
            index += 1
        if index == len(lines):
            raise TableError(f"generated table {kind!r} has no {_GENERATED_END!r}")
    return "\n".join(out) + "\n"
