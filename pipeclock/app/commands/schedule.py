"""``pipeclock schedule``: simulate a schedule without any process and show its timeline and bubble.

python -m pipeclock schedule 1f1b --stages 4 --microbatches 8 --png 1f1b.png
python -m pipeclock schedule --compare --stages 4 --microbatches 8 --png compare.png
"""

from __future__ import annotations

import argparse
import sys

from pipeclock.engine.actions import is_split
from pipeclock.engine.generators import (
    SCHEDULES,
    bubble_formula,
    bubble_formula_text,
    generate,
    get_schedule,
    supports_chunks,
)
from pipeclock.observe.diagrams import ascii_diagram, draw_comparison_png, draw_png
from pipeclock.observe.simulate import DeadlockError, simulate
from pipeclock.observe.timeline import Timeline

DEFAULT_CHUNKS = 2


class UsageError(ValueError):
    """A bad command line, reported as one line and exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help=f"the schedule: {', '.join(SCHEDULES)}")
    parser.add_argument("--compare", action="store_true", help="simulate every schedule, side by side")
    parser.add_argument("--stages", "-p", metavar="P", help="pipeline stages, one per rank (required)")
    parser.add_argument("--microbatches", "-m", metavar="M", help="micro-batches per step (required)")
    parser.add_argument(
        "--chunks",
        "-v",
        metavar="V",
        help=f"model chunks per rank, for interleaved schedules (default {DEFAULT_CHUNKS} for those, else 1)",
    )
    parser.add_argument(
        "--costs",
        metavar="F,B,W",
        help="time of a stage's forward, input-gradient backward and weight-gradient backward "
        "(default 1,1,1); schedules that do not split the backward pay B+W for their B",
    )
    parser.add_argument("--latency", metavar="L", default="0", help="time each hop between ranks takes")
    parser.add_argument("--png", metavar="FILE", help="also draw the timeline into this PNG file")


def run(args: argparse.Namespace) -> int:
    try:
        return _compare(args) if args.compare else _show_one(args)
    except (ValueError, DeadlockError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"pipeclock schedule: error: {first_line}", file=sys.stderr)
        return 2


def _show_one(args: argparse.Namespace) -> int:
    if not args.name:
        raise UsageError("name a schedule (one of " + ", ".join(SCHEDULES) + ") or pass --compare")
    p, m = _count(args.stages, "--stages"), _count(args.microbatches, "--microbatches")
    chunks = _chunks_for(args.name, args.chunks)
    timeline = _simulate(args.name, p, m, chunks, _costs(args.costs), _latency(args.latency))
    print(_header(args.name, p, m, chunks))
    print(ascii_diagram(timeline))
    print()
    print(_summary(args.name, p, m, chunks, timeline))
    if args.png:
        print(f"drew {draw_png(timeline, args.png, title=args.name)}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    if args.name:
        raise UsageError("--compare simulates every schedule; do not name one")
    p, m = _count(args.stages, "--stages"), _count(args.microbatches, "--microbatches")
    chunks = _count(args.chunks, "--chunks") if args.chunks is not None else DEFAULT_CHUNKS
    costs, latency = _costs(args.costs), _latency(args.latency)
    timelines = {}
    for name in SCHEDULES:
        name_chunks = chunks if supports_chunks(get_schedule(name)) else 1
        label = f"{name} (v={name_chunks})" if name_chunks > 1 else name
        timelines[label] = (name, name_chunks, _simulate(name, p, m, name_chunks, costs, latency))
    print(f"every schedule, p={p} stages, m={m} micro-batches; times in stage forwards")
    print(_comparison_table(p, m, timelines))
    if args.png:
        drawn = draw_comparison_png({label: entry[2] for label, entry in timelines.items()}, args.png)
        print(f"drew {drawn}")
    return 0


def _simulate(
    name: str, p: int, m: int, chunks: int, costs: tuple[float, float, float], latency: float
) -> Timeline:
    """Simulate ``name`` with per-stage ``costs`` (F, B, W); a chunk does 1/chunks of a stage's work."""
    schedule = generate(name, p, m, chunks)
    forward, backward, weight = (cost / chunks for cost in costs)
    if is_split(schedule):
        return simulate(schedule, {"F": forward, "B": backward, "W": weight}, comm_latency=latency)
    return simulate(schedule, {"F": forward, "B": backward + weight}, comm_latency=latency)


def _header(name: str, p: int, m: int, chunks: int) -> str:
    shape = f"{name}: p={p} stages, m={m} micro-batches"
    if chunks == 1:
        return f"{shape}; times in stage forwards\n"
    return (
        f"{shape}, {chunks} chunks per rank; times in stage forwards (a chunk does 1/{chunks} of a stage)\n"
    )


def _summary(name: str, p: int, m: int, chunks: int, timeline: Timeline) -> str:
    formula = bubble_formula(name, p, m, chunks)
    peaks = " ".join(_number(timeline.peak_live(rank)) for rank in range(p))
    return "\n".join(
        [
            f"makespan          {_number(timeline.makespan)}",
            f"bubble            {timeline.bubble_share:.1%} of the step (simulated);"
            f" formula {bubble_formula_text(name)} = {formula:.1%}",
            f"bubble vs ideal   {timeline.bubble_vs_ideal:.1%} longer than the busiest rank's compute",
            f"peak activations  {peaks} (stages held, rank 0 first)",
        ]
    )


def _comparison_table(p: int, m: int, timelines: dict[str, tuple[str, int, Timeline]]) -> str:
    header = ("schedule", "makespan", "bubble", "formula", "vs ideal", "peak", "peak per rank")
    rows = [header]
    for label, (name, chunks, timeline) in timelines.items():
        peaks = [timeline.peak_live(rank) for rank in range(p)]
        formula = bubble_formula(name, p, m, chunks)
        rows.append(
            (
                label,
                _number(timeline.makespan),
                f"{timeline.bubble_share:.1%}",
                f"{formula:.1%} {bubble_formula_text(name)}",
                f"{timeline.bubble_vs_ideal:.1%}",
                _number(max(peaks)),
                " ".join(_number(peak) for peak in peaks),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _number(value: float) -> str:
    return f"{value:.4g}" if value != int(value) else str(int(value))


def _count(text: str | None, option: str) -> int:
    if text is None:
        raise UsageError(f"{option} is required")
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{option} must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise UsageError(f"{option} must be a whole number >= 1, got {value}")
    return value


def _chunks_for(name: str, text: str | None) -> int:
    if text is not None:
        return _count(text, "--chunks")
    return DEFAULT_CHUNKS if supports_chunks(get_schedule(name)) else 1


def _costs(text: str | None) -> tuple[float, float, float]:
    if text is None:
        return (1.0, 1.0, 1.0)
    parts = text.split(",")
    try:
        costs = tuple(float(part) for part in parts)
    except ValueError:
        costs = ()
    if len(costs) != 3 or min(costs) < 0 or costs[0] + costs[1] + costs[2] <= 0:
        raise UsageError(f"--costs must be three numbers >= 0 like 1,1,1 (F,B,W), got {text!r}")
    return costs  # type: ignore[return-value]


def _latency(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise UsageError(f"--latency must be a number >= 0, got {text!r}")
    return value
