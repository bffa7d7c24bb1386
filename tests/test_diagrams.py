"""ASCII and PNG pictures of timelines."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from pipeclock.engine.actions import Action
from pipeclock.engine.generators import gpipe, interleaved_1f1b, naive, one_f_one_b, zero_bubble_h1
from pipeclock.observe.diagrams import (
    ascii_diagram,
    comparison_figure,
    draw_comparison_png,
    draw_png,
    timeline_figure,
)
from pipeclock.observe.simulate import simulate
from pipeclock.observe.timeline import Span, Timeline


def test_gpipe_p2_m2_in_ascii_shows_the_fill_the_drain_and_the_bubbles():
    assert ascii_diagram(simulate(gpipe(2, 2))) == (
        "rank 0 |F0 F1 .........B0    B1    |\n"  # B0 waits for rank 1's B0, which ends at 5
        "rank 1 |...F0 F1 B0    B1    ......|"
    )


def test_zb_h1_p2_m2_in_ascii_shows_the_last_rank_postponing_its_w():
    assert ascii_diagram(simulate(zero_bubble_h1(2, 2))) == (
        "rank 0 |F0 F1 ...I0 W0 I1 W1 |\nrank 1 |...F0 I0 F1 I1 W0 W1 |"
    )


def test_a_half_unit_gets_one_column_group():
    assert ascii_diagram(simulate(naive(1, 1), costs={"F": 0.5, "B": 1})) == "rank 0 |F0 B0    |"


def test_ascii_1f1b_p4_m8_fits_in_120_columns():
    rows = ascii_diagram(simulate(one_f_one_b(4, 8))).splitlines()
    assert len(rows) == 4
    assert all(len(row) <= 120 for row in rows)


def test_ascii_rows_align_even_with_chunk_labels():
    rows = ascii_diagram(simulate(interleaved_1f1b(3, 5, 2))).splitlines()
    assert len({len(row) for row in rows}) == 1
    assert "F4.1" in rows[0]


def test_measured_times_are_quantised_to_fit_the_width():
    spans = [
        Span(0, Action("F", 0), 0.0, 0.0131),
        Span(1, Action("F", 0), 0.0142, 0.0270),
        Span(1, Action("B", 0), 0.0270, 0.0533),
        Span(0, Action("B", 0), 0.0551, 0.0808),
    ]
    rows = ascii_diagram(Timeline(spans, num_ranks=2), max_width=60).splitlines()
    assert len(rows) == 2
    assert all(len(row) <= 60 for row in rows)
    assert rows[0].index("F0") < rows[1].index("F0") < rows[1].index("B0") < rows[0].index("B0")


def test_an_empty_timeline_says_so():
    assert ascii_diagram(Timeline([], num_ranks=2)) == "(empty timeline)"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG file's header; fails unless the file is a PNG."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


def test_draw_png_writes_a_png_one_row_per_rank(tmp_path):
    path = draw_png(simulate(one_f_one_b(4, 8)), tmp_path / "figures" / "1f1b.png", title="1f1b")
    width, height = png_size(path)
    assert width == 1200
    assert 250 <= height <= 400
    assert 10_000 < path.stat().st_size < 200_000


def test_draw_comparison_png_stacks_one_panel_per_schedule(tmp_path):
    named = {"gpipe": simulate(gpipe(2, 4)), "1f1b": simulate(one_f_one_b(2, 4))}
    path = draw_comparison_png(named, tmp_path / "compare.png")
    width, height = png_size(path)
    assert width == 1200
    assert 300 <= height <= 600


def test_draw_comparison_png_needs_something_to_draw(tmp_path):
    with pytest.raises(ValueError, match="nothing to draw"):
        draw_comparison_png({}, tmp_path / "empty.png")


def measured_like(timeline: Timeline, second: float = 0.00731) -> Timeline:
    """``timeline`` as a run might measure it: times in seconds, not multiples of any simple unit, and
    micro-batch 0's actions a tenth as long as the others (a warm cache, a small first batch)."""
    spans = []
    for index, span in enumerate(timeline.spans):
        start = span.start * second + 1e-5 * (index % 7)
        keep = 0.1 if span.action.microbatch == 0 else 0.9
        spans.append(Span(span.rank, span.action, start, start + span.duration * second * keep))
    return Timeline(spans, timeline.num_ranks, timeline.chunks)


LABEL = re.compile(r"[FBIW](?:\d+(?:\.\d+)?)?")  # F3, F3.1, or the op letter alone


def test_a_measured_chart_draws_every_action_in_order_even_the_shortest():
    # lab 7 with --chunks 4: 32 actions per rank, micro-batch 0's far shorter than the rest
    timeline = measured_like(simulate(interleaved_1f1b(2, 4, 4)))
    for width in (150, 40):  # 40: fewer columns than actions, so each gets one character
        rows = ascii_diagram(timeline, max_width=width).splitlines()
        for rank, row in enumerate(rows):
            drawn = LABEL.findall(row.split("|")[1])
            ran = [str(span.action) for span in timeline.spans_of(rank)]
            assert [label[0] for label in drawn] == [action[0] for action in ran], (width, row)
            assert all(label in (action, action[0]) for label, action in zip(drawn, ran, strict=True)), row
        assert all(len(row) <= max(width, len("rank 0 |") + 32 + 1) for row in rows)


def test_png_legend_swatches_are_the_boxes_colours_and_the_time_axis_has_its_unit():
    figure = timeline_figure(simulate(zero_bubble_h1(2, 4)), title="zb-h1")
    boxes = {patch.get_gid(): patch for patch in figure.axes[0].patches}
    swatches = {handle.get_label(): handle for handle in figure.legends[0].legend_handles}
    assert sorted(swatches) == ["F0 forward", "I0 input grad", "W0 weight grad"]  # the ops zb-h1 runs
    for label, swatch in swatches.items():
        box = boxes[label.split()[0]]  # the box of F0, I0, W0
        assert swatch.get_facecolor() == box.get_facecolor() and swatch.get_hatch() == box.get_hatch()
    colours = {boxes[f"F{mb}"].get_facecolor() for mb in range(4)}
    assert len(colours) == 4 and (0.35, 0.35, 0.35, 1.0) not in colours, "one colour per micro-batch"
    assert figure.axes[0].get_xlabel() == "time (stage forwards)"
    measured = measured_like(simulate(one_f_one_b(2, 4)), second=7.31)  # in ms
    figure = comparison_figure([("measured", measured)], unit="ms")
    assert figure.axes[0].get_xlabel() == "time (ms)"
    assert f"makespan {measured.makespan:.2f} ms" in figure.axes[0].get_title(loc="left")
