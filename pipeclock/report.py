"""Turning a measured run into what a person reads: a table, a Chrome trace, and a picture.

The picture puts the *predicted* timeline (the simulator, fed with the op durations this run measured)
above the *measured* one, drawn by the same code, so the gap between theory and practice is visible.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pipeclock.actions import Schedule
from pipeclock.diagrams import draw_comparison_png
from pipeclock.generators import bubble_formula, bubble_formula_text
from pipeclock.metrics import RunReport
from pipeclock.simulate import simulate
from pipeclock.timeline import Span, Timeline

MIB = 2**20


def measured_costs(report: RunReport) -> dict[str, float]:
    """Median compute time (seconds) of each op over the measured steps, per stage (all chunks)."""
    durations: dict[str, list[float]] = {}
    for timeline in report.measured:
        for span in timeline.spans:
            durations.setdefault(span.action.op, []).append(span.compute)
    return {op: statistics.median(times) * report.chunks for op, times in durations.items()}


def predicted_timeline(report: RunReport, schedule: Schedule) -> Timeline:
    """The simulator's timeline of ``schedule`` with this run's measured op costs (seconds)."""
    costs = measured_costs(report)
    return simulate(schedule, {op: cost / report.chunks for op, cost in costs.items()})


def summary_lines(report: RunReport, schedule_name: str, schedule: Schedule, batch_size: int) -> list[str]:
    """The end-of-run table: throughput, bubble against the formula, and per-rank busy/memory/CPU."""
    p, chunks = report.timelines[0].num_ranks, report.chunks
    m = report.timelines[0].num_microbatches
    step = report.step_seconds
    formula = bubble_formula(schedule_name, p, m, chunks) if schedule_name in _KNOWN else None
    predicted = predicted_timeline(report, schedule)
    lines = [
        f"step time        {step * 1e3:.2f} ms (median of {len(report.measured)} steps), "
        f"{batch_size / step:,.0f} samples/s",
        f"bubble           measured {report.bubble_share:.1%} of the step"
        + (f"; formula {bubble_formula_text(schedule_name)} = {formula:.1%}" if formula is not None else "")
        + f"; simulated with the measured op times {predicted.bubble_share:.1%}",
        "",
        "rank   busy   comm wait   CPU    peak activations   peak RSS",
    ]
    for rank, run in enumerate(report.ranks):
        peak = report.peak_activation_bytes(rank)
        lines.append(
            f"{rank:>4}  {report.busy_fraction(rank):5.1%}  {report.wait_fraction(rank):9.1%}  "
            f"{run.cpu_percent:4.0f}%  {_mib(peak):>15}   {run.peak_rss / MIB:6.0f} MiB"
            + (f"   GPU {run.gpu_utilization:.0f}%" if run.gpu_utilization is not None else "")
            + (f"   CUDA peak {_mib(run.cuda_peak_bytes)}" if run.cuda_peak_bytes is not None else "")
        )
    return lines


_KNOWN = {"naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MIB:.2f} MiB"


def write_trace(report: RunReport, path: str | Path) -> Path:
    """Every step of the run as one Chrome trace (chrome://tracing, ui.perfetto.dev), times in seconds."""
    spans = [span for rank in report.ranks for step in rank.steps for span in step.spans]
    origin = min(span.start for span in spans)
    shifted = [Span(s.rank, s.action, s.start - origin, s.end - origin, s.wait) for s in spans]
    trace = Timeline(shifted, num_ranks=len(report.ranks), chunks=report.chunks).to_chrome_trace(
        time_unit_us=1e6
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return path


def draw_timelines(report: RunReport, schedule: Schedule, path: str | Path, title: str) -> Path:
    """Predicted (simulated with measured costs) above measured (the last step), both in milliseconds."""
    predicted = _in_milliseconds(predicted_timeline(report, schedule))
    measured = _in_milliseconds(report.timelines[-1])
    return draw_comparison_png(
        [(f"{title}, predicted (ms)", predicted), (f"{title}, measured last step (ms)", measured)], path
    )


def _in_milliseconds(timeline: Timeline) -> Timeline:
    spans = [Span(s.rank, s.action, s.start * 1e3, s.end * 1e3, s.wait * 1e3) for s in timeline.spans]
    return Timeline(spans, timeline.num_ranks, timeline.chunks)
