"""Pictures of a `Timeline`: an ASCII chart for the terminal and PNG charts for the docs.

Both draw from a timeline, not from a schedule, so a measured run is drawn by the same code as a
simulated one. One row per rank, time flowing to the right, idle time left empty: the bubble is what
you see between the boxes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction
from itertools import pairwise
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
    then twice as wide. Otherwise (measured times, say) time is first quantised to cells of a label's
    width, as fine as ``max_width`` allows but no finer than the shortest span. If two actions of a rank
    would then share a cell, one would vanish: time is scaled instead to ``max_width`` characters (more
    only when a rank ran more actions than that), each action at least one character wide and in the
    order the rank ran them, showing its label where it fits, else its op letter alone (``F``), never a
    cut label that would read as another micro-batch. Zero-length spans are not drawn.
    """
    if not timeline.spans:
        return "(empty timeline)"
    label = max(len(str(s.action)) for s in timeline.spans)
    prefix = len(_row_prefix(timeline.num_ranks - 1, timeline.num_ranks))
    unit = _exact_unit(timeline)
    cells = round(timeline.makespan / unit) if unit else 0
    fits = prefix + cells * label + 1 <= max_width
    ranks, start = range(timeline.num_ranks), timeline.start
    if unit and (fits or unit >= _shortest_span(timeline) - _EPSILON):
        roomy = prefix + cells * (label + 1) + 1 <= max_width
        cell_width = label + 1 if roomy else label
    else:
        cell_width = label + 1
        cells = max(1, (max_width - prefix - 1) // cell_width)
        unit = max(timeline.makespan / cells, _shortest_span(timeline))
        cells = max(1, round(timeline.makespan / unit))
    if all(_keeps_every_action(timeline.spans_of(r), start, unit, cells) for r in ranks):
        rows = [_draw_row(timeline.spans_of(r), start, unit, cells, cell_width) for r in ranks]
    else:
        columns = max(max_width - prefix - 1, max(len(_drawn(timeline.spans_of(r))) for r in ranks))
        rows = [_draw_scaled_row(timeline.spans_of(r), start, timeline.makespan, columns) for r in ranks]
    heads = [_row_prefix(rank, timeline.num_ranks) for rank in ranks]
    return "\n".join(f"{head}{row}|" for head, row in zip(heads, rows, strict=True))


def _row_prefix(rank: int, num_ranks: int) -> str:
    return f"rank {rank:>{len(str(num_ranks - 1))}} |"


def _exact_unit(timeline: Timeline) -> float | None:
    """The largest time dividing every span's start and end, when all are simple fractions; else None."""
    origin = timeline.start
    times = [t - origin for s in timeline.spans for t in (s.start, s.end)]
    fractions = [Fraction(t).limit_denominator(_MAX_DENOMINATOR) for t in times]
    if any(abs(f - t) > _EPSILON for f, t in zip(fractions, times, strict=True)):
        return None
    denominator = math.lcm(*(f.denominator for f in fractions))
    numerator = math.gcd(*(int(f * denominator) for f in fractions))
    return numerator / denominator if numerator else None


def _shortest_span(timeline: Timeline) -> float:
    return min((s.duration for s in timeline.spans if s.duration > _EPSILON), default=1.0)


def _cells(span: Span, origin: float, unit: float, cells: int) -> tuple[int, int]:
    """The cells ``[first, last)`` a span covers: at least one, within the row."""
    first = min(round((span.start - origin) / unit), cells - 1)
    return first, min(max(first + 1, round((span.end - origin) / unit)), cells)


def _keeps_every_action(spans: Iterable[Span], origin: float, unit: float, cells: int) -> bool:
    """Whether each span gets cells of its own, none overwritten by the next."""
    ranges = [_cells(span, origin, unit, cells) for span in _drawn(spans)]
    return all(after[0] >= before[1] for before, after in pairwise(ranges))


def _draw_row(spans: Iterable[Span], origin: float, unit: float, cells: int, cell_width: int) -> str:
    row = [IDLE] * (cells * cell_width)
    for span in _drawn(spans):
        first, last = _cells(span, origin, unit, cells)
        room = (last - first) * cell_width
        row[first * cell_width : last * cell_width] = str(span.action).ljust(room)[:room]
    return "".join(row)


def _drawn(spans: Iterable[Span]) -> list[Span]:
    return [span for span in spans if span.duration > _EPSILON]


def _draw_scaled_row(spans: Iterable[Span], origin: float, makespan: float, columns: int) -> str:
    """One rank's spans on ``columns`` characters, in proportion to time, each span at least one
    character wide and after the one before: a short action is squeezed, never hidden by its neighbour.

    Going left to right, a span starts where time puts it, or right after the previous span, and ends
    where time puts it, but at least one character later, and early enough to leave one character for
    each span still to come.
    """
    drawn = _drawn(spans)
    scale = columns / makespan if makespan > 0 else 0.0
    row, reached = [IDLE] * columns, 0
    for index, span in enumerate(drawn):
        later = len(drawn) - index - 1
        first = min(max(round((span.start - origin) * scale), reached), columns - later - 1)
        last = min(max(round((span.end - origin) * scale), first + 1), columns - later)
        row[first:last] = _fitted_label(span, last - first)
        reached = last
    return "".join(row)


def _fitted_label(span: Span, room: int) -> str:
    """The span's label padded to ``room``; its op letter alone where the whole label does not fit."""
    label = str(span.action)
    return (label if len(label) <= room else span.action.op).ljust(room)


SIMULATOR_UNIT = "stage forwards"  # the simulator's time with its default costs: one stage's F is 1


def draw_png(timeline: Timeline, path: str | Path, title: str = "", unit: str = SIMULATOR_UNIT) -> Path:
    """Draw ``timeline`` as a Gantt chart: one colour per micro-batch, F solid, B light, W hatched.

    The title is followed by p, m, the makespan and the bubble share, so a figure always says what it
    shows; ``unit`` names the timeline's time unit (``"ms"`` for a measured step) on the time axis.
    """
    return save_figure(timeline_figure(timeline, title, unit), path)


def timeline_figure(timeline: Timeline, title: str = "", unit: str = SIMULATOR_UNIT):
    """The matplotlib ``Figure`` `draw_png` saves."""
    return comparison_figure([(title, timeline)], unit)


def draw_comparison_png(
    named_timelines: Mapping[str, Timeline] | Iterable[tuple[str, Timeline]],
    path: str | Path,
    unit: str = SIMULATOR_UNIT,
) -> Path:
    """One panel per schedule, on a shared time axis so that shorter steps look shorter."""
    return save_figure(comparison_figure(named_timelines, unit), path)


def comparison_figure(
    named_timelines: Mapping[str, Timeline] | Iterable[tuple[str, Timeline]], unit: str = SIMULATOR_UNIT
):
    """The matplotlib ``Figure`` `draw_comparison_png` saves: a panel per ``(title, timeline)``."""
    named = list(named_timelines.items() if isinstance(named_timelines, Mapping) else named_timelines)
    if not named:
        raise ValueError("nothing to draw: no timelines given")
    heights = [1.0 + 0.45 * timeline.num_ranks for _, timeline in named]
    figure = _figure(height=sum(heights) + (0.8 if len(named) > 1 else 0.4))
    panels = figure.subplots(
        len(named), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    extent = max(timeline.makespan for _, timeline in named)
    for axes, (name, timeline) in zip(panels[:, 0], named, strict=True):
        _draw_axes(axes, timeline, headline(name, timeline, unit), extent)
    panels[-1, 0].set_xlabel(f"time ({unit})")
    _add_legend(figure, [timeline for _, timeline in named])
    return figure


def _figure(height: float):
    """A 12-inch-wide figure that renders with Agg and never touches pyplot's global state."""
    from matplotlib.figure import Figure

    return Figure(figsize=(12, height))


def headline(title: str, timeline: Timeline, unit: str = SIMULATOR_UNIT) -> str:
    """A panel's title: ``title``, then the timeline's shape, makespan (in ``unit``) and bubble share."""
    shape = f"p={timeline.num_ranks}, m={timeline.num_microbatches}"
    if timeline.chunks > 1:
        shape += f", chunks={timeline.chunks}"
    figures = (
        f"{shape}, makespan {duration_text(timeline.makespan, unit)}, bubble {timeline.bubble_share:.1%}"
    )
    return f"{title}: {figures}" if title else figures


def duration_text(value: float, unit: str) -> str:
    """A time as the pictures and the printed summaries both write it: ``708.52 ms``, or ``33``."""
    return f"{value:.2f} ms" if unit == "ms" else f"{value:g}"


_LIGHTEN = {"F": 0.0, "B": 0.45, "I": 0.45, "W": 0.7}
_WAIT_GREY = (0.75, 0.75, 0.75)
_HATCH = {"F": "", "B": "", "I": "...", "W": "///"}
_OP_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
_WAITING = "waiting for data"


def box_colour(microbatch: int, op: str, num_microbatches: int) -> tuple[float, float, float]:
    """The fill of an action's box: its micro-batch's colour, lighter for the backward ops."""
    colours = _microbatch_colours(num_microbatches)
    return _lighten(colours[microbatch % len(colours)], _LIGHTEN[op])


def _draw_axes(axes, timeline: Timeline, title: str, extent: float) -> None:
    """Draw ``timeline`` on ``axes`` whose time axis spans ``extent`` (shared axes share one extent).

    Each box carries its action's name as its ``gid`` (``"F3.1"``), so a test can find it.
    """
    char_width = extent / _LABEL_CHARS_ACROSS
    for span in timeline.spans:
        if span.duration <= 0:
            continue
        left = span.start - timeline.start
        if span.wait > 0:  # blocked on a receive: drawn as a thin grey lead-in, not as work
            axes.barh(
                span.rank, span.wait, left=left, height=0.25, color=_WAIT_GREY, linewidth=0, gid=_WAITING
            )
        axes.barh(
            span.rank,
            span.compute,
            left=left + span.wait,
            height=0.8,
            color=box_colour(span.action.microbatch, span.action.op, timeline.num_microbatches),
            edgecolor="black",
            linewidth=0.4,
            hatch=_HATCH[span.action.op],
            gid=str(span.action),
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


def _add_legend(figure, timelines: list[Timeline]) -> None:
    """One swatch per op the timelines contain, drawn exactly as micro-batch 0's box of that op (``F0``)
    is: the boxes' colour says the micro-batch, the lightness and hatch the op."""
    from matplotlib.patches import Patch

    ops = {span.action.op for timeline in timelines for span in timeline.spans}
    count = max(timeline.num_microbatches for timeline in timelines)
    handles = [
        Patch(
            facecolor=box_colour(0, op, count),
            hatch=_HATCH[op],
            edgecolor="black",
            linewidth=0.4,
            label=f"{op}0 {_OP_NAMES[op]}",
        )
        for op in "FBIW"
        if op in ops
    ]
    if any(span.wait > 0 for timeline in timelines for span in timeline.spans):
        handles.append(Patch(facecolor=_WAIT_GREY, label=_WAITING))
    figure.legend(
        handles=handles,
        loc="upper right",
        bbox_to_anchor=(0.98, 1.0),
        ncol=len(handles) + 1,
        fontsize=8,
        frameon=False,
        title="colour: micro-batch (0 shown)",
        title_fontsize=8,
        alignment="left",
    )


def save_figure(figure, path: str | Path) -> Path:
    """Write ``figure`` as a PNG; its panels' titles also go into the file's ``Description`` text, so
    the figures a picture shows can be read back from the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    titles = [axes.get_title(loc="left") for axes in figure.axes]
    figure.savefig(path, dpi=100, metadata={"Description": "\n".join(titles)})
    return path
