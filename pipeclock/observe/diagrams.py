"""Pictures of a `Timeline`: an ASCII chart for the terminal and PNG charts for the docs.

Both draw from a timeline, not from a schedule, so a measured run is drawn by the same code as a
simulated one. One row per rank, time flowing to the right, idle time left empty: the bubble is what
you see between the boxes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction
from pathlib import Path

from pipeclock.observe.timeline import Span, Timeline

IDLE = "."
MAX_WIDTH = 120
_EPSILON = 1e-9
_MAX_DENOMINATOR = 12
_LABEL_CHARS_ACROSS = 200  # 7-point characters across a 12-inch chart


def ascii_diagram(timeline: Timeline, max_width: int = MAX_WIDTH) -> str:
    """One row per rank, each span written as its action (``F3``, ``B3``, ``W3``, ``F3.1``), idle as dots.

    When all times are whole multiples of a unit no shorter than the shortest span (1 in the simulator
    with default costs, 1/2 with two chunks), each unit gets the same number of characters: enough for
    the longest label, plus a space when the rows still fit in ``max_width``. A B that costs two F's is
    then twice as wide. Otherwise (measured times, say) time is quantised so that the rows fit, and
    labels are cut to the room they have. Zero-length spans are not drawn.
    """
    if not timeline.spans:
        return "(empty timeline)"
    label = max(len(str(s.action)) for s in timeline.spans)
    prefix = len(_row_prefix(timeline.num_ranks - 1, timeline.num_ranks))
    unit = _exact_unit(timeline)
    cells = round(timeline.makespan / unit) if unit else 0
    fits = prefix + cells * label + 1 <= max_width
    if unit and (fits or unit >= _shortest_span(timeline) - _EPSILON):
        roomy = prefix + cells * (label + 1) + 1 <= max_width
        cell_width = label + 1 if roomy else label
    else:
        cell_width = label + 1
        cells = max(1, (max_width - prefix - 1) // cell_width)
        unit = max(timeline.makespan / cells, _shortest_span(timeline))
        cells = max(1, round(timeline.makespan / unit))
    rows = []
    for rank in range(timeline.num_ranks):
        text = _draw_row(timeline.spans_of(rank), timeline.start, unit, cells, cell_width)
        rows.append(f"{_row_prefix(rank, timeline.num_ranks)}{text}|")
    return "\n".join(rows)


def _row_prefix(rank: int, num_ranks: int) -> str:
    return f"rank {rank:>{len(str(num_ranks - 1))}} |"


def _exact_unit(timeline: Timeline) -> float | None:
    """The largest time dividing every span's start and end, when all are simple fractions; else None."""
    times = [t - timeline.start for s in timeline.spans for t in (s.start, s.end)]
    fractions = [Fraction(t).limit_denominator(_MAX_DENOMINATOR) for t in times]
    if any(abs(f - t) > _EPSILON for f, t in zip(fractions, times, strict=True)):
        return None
    denominator = math.lcm(*(f.denominator for f in fractions))
    numerator = math.gcd(*(int(f * denominator) for f in fractions))
    return numerator / denominator if numerator else None


def _shortest_span(timeline: Timeline) -> float:
    return min((s.duration for s in timeline.spans if s.duration > _EPSILON), default=1.0)


def _draw_row(spans: Iterable[Span], origin: float, unit: float, cells: int, cell_width: int) -> str:
    row = [IDLE] * (cells * cell_width)
    for span in spans:
        if span.duration <= _EPSILON:
            continue
        first = min(round((span.start - origin) / unit), cells - 1)
        last = min(max(first + 1, round((span.end - origin) / unit)), cells)
        room = (last - first) * cell_width
        row[first * cell_width : last * cell_width] = str(span.action).ljust(room)[:room]
    return "".join(row)


def draw_png(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """Draw ``timeline`` as a Gantt chart: one colour per micro-batch, F solid, B light, W hatched.

    The title is followed by p, m and the bubble share, so a figure always says what it shows.
    """
    figure = _figure(height=1.4 + 0.45 * timeline.num_ranks)
    axes = figure.subplots()
    _draw_axes(axes, timeline, _headline(title, timeline), extent=timeline.makespan)
    axes.set_xlabel("time")
    _add_legend(figure)
    return _save(figure, path)


def draw_comparison_png(
    named_timelines: Mapping[str, Timeline] | Iterable[tuple[str, Timeline]], path: str | Path
) -> Path:
    """One panel per schedule, on a shared time axis so that shorter steps look shorter."""
    named = list(named_timelines.items() if isinstance(named_timelines, Mapping) else named_timelines)
    if not named:
        raise ValueError("nothing to draw: no timelines given")
    heights = [1.0 + 0.45 * timeline.num_ranks for _, timeline in named]
    figure = _figure(height=sum(heights) + 0.8)
    panels = figure.subplots(
        len(named), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    extent = max(timeline.makespan for _, timeline in named)
    for axes, (name, timeline) in zip(panels[:, 0], named, strict=True):
        _draw_axes(axes, timeline, _headline(name, timeline), extent)
    panels[-1, 0].set_xlabel("time")
    _add_legend(figure)
    return _save(figure, path)


def _figure(height: float):
    """A 12-inch-wide figure that renders with Agg and never touches pyplot's global state."""
    from matplotlib.figure import Figure

    return Figure(figsize=(12, height))


def _headline(title: str, timeline: Timeline) -> str:
    shape = f"p={timeline.num_ranks}, m={timeline.num_microbatches}"
    if timeline.chunks > 1:
        shape += f", chunks={timeline.chunks}"
    figures = f"{shape}, makespan {timeline.makespan:g}, bubble {timeline.bubble_share:.1%}"
    return f"{title}: {figures}" if title else figures


_LIGHTEN = {"F": 0.0, "B": 0.45, "I": 0.45, "W": 0.7}
_WAIT_GREY = (0.75, 0.75, 0.75)
_HATCH = {"F": "", "B": "", "I": "...", "W": "///"}


def _draw_axes(axes, timeline: Timeline, title: str, extent: float) -> None:
    """Draw ``timeline`` on ``axes`` whose time axis spans ``extent`` (shared axes share one extent)."""
    colours = _microbatch_colours(timeline.num_microbatches)
    char_width = extent / _LABEL_CHARS_ACROSS
    for span in timeline.spans:
        if span.duration <= 0:
            continue
        colour = _lighten(colours[span.action.microbatch % len(colours)], _LIGHTEN[span.action.op])
        left = span.start - timeline.start
        if span.wait > 0:  # blocked on a receive: drawn as a thin grey lead-in, not as work
            axes.barh(span.rank, span.wait, left=left, height=0.25, color=_WAIT_GREY, linewidth=0)
        axes.barh(
            span.rank,
            span.compute,
            left=left + span.wait,
            height=0.8,
            color=colour,
            edgecolor="black",
            linewidth=0.4,
            hatch=_HATCH[span.action.op],
        )
        if span.compute >= char_width * (len(str(span.action)) + 0.5):
            middle = left + span.wait + span.compute / 2
            axes.text(middle, span.rank, str(span.action), ha="center", va="center", fontsize=7, clip_on=True)
    axes.set_yticks(range(timeline.num_ranks), [f"rank {r}" for r in range(timeline.num_ranks)])
    axes.set_ylim(timeline.num_ranks - 0.5, -0.5)
    axes.set_xlim(0, max(extent, _EPSILON))
    axes.set_title(title, fontsize=10, loc="left")
    axes.spines[["top", "right"]].set_visible(False)


def _microbatch_colours(count: int) -> list[tuple[float, float, float]]:
    from matplotlib import colormaps

    palette = colormaps["tab10" if count <= 10 else "tab20"]
    return [palette(i % palette.N)[:3] for i in range(max(count, 1))]


def _lighten(colour: tuple[float, float, float], amount: float) -> tuple[float, float, float]:
    return tuple(c + (1.0 - c) * amount for c in colour)  # type: ignore[return-value]


def _add_legend(figure) -> None:
    from matplotlib.patches import Patch

    grey = (0.35, 0.35, 0.35)
    handles = [
        Patch(facecolor=_lighten(grey, _LIGHTEN[op]), hatch=_HATCH[op], edgecolor="black", label=text)
        for op, text in (
            ("F", "F forward"),
            ("B", "B backward"),
            ("I", "I input grad"),
            ("W", "W weight grad"),
        )
    ]
    handles.append(Patch(facecolor=_WAIT_GREY, label="waiting for data"))
    figure.legend(
        handles=handles, loc="upper right", bbox_to_anchor=(0.98, 1.0), ncol=5, fontsize=8, frameon=False
    )


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    figure.savefig(path, dpi=100)
    return path
