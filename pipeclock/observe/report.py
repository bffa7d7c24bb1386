"""Turning a measured run into what a person reads: a table, a Chrome trace, and a picture.

The picture puts the *predicted* timeline (the simulator, fed with the op durations this run measured)
above the *measured* one, drawn by the same code, so the gap between theory and practice is visible.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeclock.engine.actions import Schedule, dependencies, placement_of
from pipeclock.engine.generators import SCHEDULES, bubble_formula, bubble_formula_text
from pipeclock.engine.program import lower
from pipeclock.observe.diagrams import MAX_WIDTH, ascii_diagram, comparison_figure, duration_text, save_figure
from pipeclock.observe.metrics import RunReport
from pipeclock.observe.simulate import Link, simulate
from pipeclock.observe.timeline import Span, Timeline

MIB = 2**20


def measured_costs(report: RunReport) -> dict[str, float]:
    """Median compute time (seconds) of each op over the measured steps, per stage (all chunks)."""
    durations: dict[str, list[float]] = {}
    for timeline in report.measured:
        for span in timeline.spans:
            durations.setdefault(span.action.op, []).append(span.compute)
    return {op: statistics.median(times) * report.chunks for op, times in durations.items()}


def predicted_timeline(report: RunReport, schedule: Schedule, link: Link = Link()) -> Timeline:
    """The simulator's timeline of ``schedule``'s program with this run's measured op costs (seconds),
    each message costing what ``link`` says for the mean bytes this run's messages carried."""
    costs = measured_costs(report)
    per_message = message_bytes(report, schedule) if link.bandwidth else 0.0
    per_op = {op: cost / report.chunks for op, cost in costs.items()}
    return simulate(schedule, per_op, link.latency, link.bandwidth, lambda _send: per_message)


def _link_text(link: Link) -> str:
    """What the prediction charged each message, when it charged anything."""
    if link == Link():
        return ""
    size = f" + its bytes at {link.bandwidth / 2**20:g} MiB/s" if link.bandwidth else ""
    return f" (each message {link.latency * 1e6:g} us{size})"


def message_bytes(report: RunReport, schedule: Schedule) -> float:
    """The mean bytes of one activation or gradient message over the measured steps."""
    sends = sum(i.kind in ("SEND_F", "SEND_B") for rank in lower(schedule) for i in rank)
    pipelines = len(report.ranks) // len(schedule)
    steps = report.measured_steps
    sent = statistics.fmean(sum(run.steps[step].sent_bytes for run in report.ranks) for step in steps)
    return sent / (sends * pipelines) if sends else 0.0


@dataclass(frozen=True)
class MedianStep:
    """The one measured step a run's summary quotes and its picture draws.

    It is the step whose step call (on the slowest rank) took the median time, the lower of the two
    middle ones for an even count. One real step, not a mean over steps: a mean has no picture, and the
    printed figures must be the ones the picture shows.
    """

    timeline: Timeline  # its actions, times in seconds from the step's first action
    seconds: float  # the slowest rank's step call, communication and loss included
    count: int  # how many measured steps it is the median of
    index: int  # its place among the run's steps (warm-up included): ``report.timelines[index]``

    @property
    def which(self) -> str:
        """How the summary and the picture name this step."""
        return f"the median of {self.count} steps" if self.count > 1 else "the one measured step"


def median_step(report: RunReport) -> MedianStep:
    """The measured step of median step time (see `MedianStep`)."""
    middle = report.median_index
    return MedianStep(report.timelines[middle], report.seconds_of(middle), len(report.measured), middle)


def typical_step(report: RunReport) -> Timeline:
    """What a step of this run usually looks like: `median_step`'s timeline. (The last step may have
    been stretched by a hiccup of the machine, such as another process taking the core.)"""
    return median_step(report).timeline


def summary_lines(
    report: RunReport, schedule_name: str, schedule: Schedule, batch_size: int, link: Link = Link()
) -> list[str]:
    """The end-of-run table: the median step's time, throughput and bubble (the figures `draw_runs`
    puts in its picture's title), the formula and the simulator (with ``link``) beside them, then per
    rank busy share, waits, CPU and memory (means over the measured steps)."""
    p, chunks = len(schedule), report.chunks  # the pipeline's ranks (a replica's, with dp > 1)
    m = report.timelines[0].num_microbatches
    step = median_step(report)
    formula = bubble_formula(schedule_name, p, m, chunks) if schedule_name in SCHEDULES else None
    predicted = predicted_timeline(report, schedule, link)
    lines = [
        f"step time        {duration_text(step.seconds * 1e3, 'ms')} ({step.which}, the slowest rank's step "
        f"call), {batch_size / step.seconds:,.0f} samples/s",
        f"bubble           measured {step.timeline.bubble_share:.1%} of that step's makespan "
        f"({duration_text(step.timeline.makespan * 1e3, 'ms')}, first action to last)"
        + (f"; formula {bubble_formula_text(schedule_name)} = {formula:.1%}" if formula is not None else "")
        + f"; simulated with the measured op times {predicted.bubble_share:.1%}{_link_text(link)}",
        *_tensor_parallel_lines(report),
        "",
    ]
    wide, timed = report.data_parallel or len(report.hosts) > 1, bool(report.timed_steps)
    lines.append(
        "rank   busy   comm wait   CPU    peak activations   peak RSS"
        + ("   tp coll" if timed else "")
        + ("   dp sync   node" if wide else "")
    )
    for rank, run in enumerate(report.ranks):
        peak = report.peak_activation_bytes(rank)
        lines.append(
            f"{rank:>4}  {step.timeline.busy_fraction(rank):5.1%}  {_wait_share(step, rank):9.1%}  "
            f"{run.cpu_percent:4.0f}%  {_mib(peak):>15}   {run.peak_rss / MIB:6.0f} MiB"
            + (f"   GPU {run.gpu_utilization:.0f}%" if run.gpu_utilization is not None else "")
            + (f"   CUDA peak {_mib(run.cuda_peak_bytes)}" if run.cuda_peak_bytes is not None else "")
            + (f"  {statistics.fmean(_collective_shares(report, rank)):7.1%}" if timed else "")
            + (f"  {_sync_share(report, step, rank):7.1%}   {run.host}" if wide else "")
        )
    lines.append(
        "(busy, comm wait"
        + (", dp sync" if wide else "")
        + ": shares of that step; "
        + ("tp coll: of the profiled steps' step calls; " if timed else "")
        + "CPU and RSS: the whole run; peak activations: the largest of any step)"
    )
    if wide:
        lines += ["", *_communication_lines(report, step)]
    return lines


def _tensor_parallel_lines(report: RunReport) -> list[str]:
    """Where steps were profiled for them: the time inside tensor parallel's collectives, beside the step
    call it was part of (means over the ranks and the profiled steps)."""
    timed = report.timed_steps
    if not timed:
        return []
    records = [run.steps[step] for run in report.ranks for step in timed]
    inside = statistics.fmean(record.collective_seconds for record in records)
    call = statistics.fmean(record.seconds for record in records)
    share = statistics.fmean(s for rank in range(len(report.ranks)) for s in _collective_shares(report, rank))
    fewest, most = min(r.collective_calls for r in records), max(r.collective_calls for r in records)
    calls = f"{fewest}" if fewest == most else f"{fewest} to {most}"
    on_cuda = any(run.cuda_peak_bytes is not None for run in report.ranks)
    return [
        f"tensor parallel  inside its collectives {duration_text(inside * 1e3, 'ms')} of each rank's "
        f"{duration_text(call * 1e3, 'ms')} step call ({share:.1%}; {calls} calls a rank), means over "
        f"{len(timed)} step(s) profiled for it, which the other figures leave out"
        + ("; host time: the GPU's time in them is not measured" if on_cuda else "")
    ]


def _collective_shares(report: RunReport, rank: int) -> list[float]:
    """For each profiled step, the share of this rank's step call spent inside tp's collectives."""
    records = [report.ranks[rank].steps[step] for step in report.timed_steps]
    return [r.collective_seconds / r.seconds if r.seconds else 0.0 for r in records]


def _wait_share(step: MedianStep, rank: int) -> float:
    """Share of the step's makespan this rank spent blocked on receives inside its actions."""
    makespan = step.timeline.makespan
    return sum(s.wait for s in step.timeline.spans_of(rank)) / makespan if makespan else 0.0


def _sync_share(report: RunReport, step: MedianStep, rank: int) -> float:
    """Share of this rank's step call spent summing gradients across data-parallel replicas."""
    record = report.ranks[rank].steps[step.index]
    return record.sync_seconds / record.seconds if record.seconds else 0.0


def _communication_lines(report: RunReport, step: MedianStep) -> list[str]:
    """Where the communication time went: pipeline messages against the replicas' gradient sums."""
    ranks = range(len(report.ranks))
    waits = statistics.fmean(_wait_share(step, rank) for rank in ranks)
    syncs = statistics.fmean(_sync_share(report, step, rank) for rank in ranks)
    by_host = {host: [r.rank for r in report.ranks if r.host == host] for host in report.hosts}
    nodes = "; ".join(f"{host}: ranks {', '.join(map(str, ranks))}" for host, ranks in by_host.items())
    return [
        f"communication    waiting for pp messages {waits:.1%} of the step, dp gradient sums {syncs:.1%} "
        "(mean over ranks)",
        f"nodes            {len(by_host)}: {nodes}",
    ]


def side_by_side(names: Sequence[str], rows: dict[str, Sequence[str]]) -> list[str]:
    """A text table with one column per run (``names``) and one line per ``rows`` item, label first."""
    label_width = 2 + max(len(label) for label in rows)
    width = 3 + max(len(text) for text in (*names, *(value for values in rows.values() for value in values)))
    lines = [" " * label_width + "".join(f"{name:>{width}}" for name in names)]
    lines += [
        f"{label:{label_width}}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows.items()
    ]
    return lines


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
    trace["traceEvents"] += [
        {"name": "dp sync", "cat": "dp", "ph": "X", "pid": run.rank, "tid": 1,
         "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6}
        for run in report.ranks for step in run.steps for start, end in step.syncs
    ]  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return path


def draw_runs(
    runs: Sequence[tuple[str, RunReport, Schedule]],
    path: str | Path,
    predicted: bool = True,
    link: Link = Link(),
) -> Path:
    """Several runs, e.g. two schedules, on one shared time axis in milliseconds, so a shorter step looks
    shorter: for each ``(title, report, schedule)``, its predicted timeline (unless ``predicted`` is
    False; messages costing what ``link`` says) above its `median_step`."""
    return save_figure(runs_figure(runs, predicted, link), path)


def runs_figure(runs: Sequence[tuple[str, RunReport, Schedule]], predicted: bool = True, link: Link = Link()):
    """The matplotlib ``Figure`` `draw_runs` saves. A measured panel's title gives the median step's
    time, makespan and bubble, as `summary_lines` prints them."""
    panels = []
    for title, report, schedule in runs:
        if predicted:
            timeline = predicted_timeline(report, schedule, link)
            panels.append((f"{title}, predicted", _in_milliseconds(timeline)))
        step = median_step(report)
        measured = f"{title}, measured, {step.which} (step time {duration_text(step.seconds * 1e3, 'ms')})"
        panels.append((measured, _in_milliseconds(step.timeline)))
    return comparison_figure(panels, unit="ms")


def draw_activations_held(runs: Sequence[tuple[str, RunReport]], path: str | Path) -> Path:
    """How many micro-batches' activations each rank holds during each run's `median_step`.

    One panel per ``(title, report)`` on a shared time axis (ms) and a shared scale, so the schedule
    that needs more memory has the taller curve; each title gives the measured peak bytes per rank.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 0.8 + 2.0 * len(runs)))
    panels = figure.subplots(len(runs), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    highest = 0.0
    for axes, (title, report) in zip(panels, runs, strict=True):
        timeline = _in_milliseconds(typical_step(report))
        for rank in range(timeline.num_ranks):
            times, held = timeline.held_over_time(rank)
            axes.step(times, held, where="post", label=f"rank {rank}")
            highest = max(highest, *held)
        peaks = " / ".join(_mib(report.peak_activation_bytes(rank)) for rank in range(timeline.num_ranks))
        per_chunk = f", a chunk counts 1/{timeline.chunks}" if timeline.chunks > 1 else ""
        which = median_step(report).which
        axes.set_title(
            f"{title}, measured, {which}{per_chunk}; peak activations {peaks} (rank 0 first)", loc="left"
        )
        axes.set_ylabel("micro-batches held")
        axes.spines[["top", "right"]].set_visible(False)
    panels[0].set_ylim(0, highest * 1.1 or 1.0)
    panels[0].set_xlim(0, max(typical_step(report).makespan * 1e3 for _, report in runs))
    panels[0].legend(loc="upper right", fontsize=8, frameon=False)
    panels[-1].set_xlabel("time (ms)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def measured_ascii(report: RunReport, max_width: int = 150) -> str:
    """The run's `median_step` as an ASCII chart for the terminal.

    A span's time blocked on a receive is drawn as idle (dots), because the rank did no work then: a
    rank that waits for its input does not look busy. The chart is made just wide enough (up to
    ``max_width``) for the shortest action to get a cell of its own and keep its label; in a narrower
    chart short actions would overwrite each other.
    """
    step = typical_step(report)
    working = Timeline(
        [Span(s.rank, s.action, s.start + s.wait, s.end) for s in step.spans], step.num_ranks, step.chunks
    )
    return ascii_diagram(working, min(max(_width_for_every_action(working), MAX_WIDTH), max_width))


def _width_for_every_action(timeline: Timeline) -> int:
    label = max(len(str(s.action)) for s in timeline.spans)
    shortest = min((s.duration for s in timeline.spans if s.duration > 0), default=timeline.makespan)
    cells = math.ceil(timeline.makespan / shortest) if shortest > 0 else 1
    prefix = len(f"rank {timeline.num_ranks - 1} |")
    return prefix + cells * (label + 1) + 1


def messages_per_rank(schedule: Schedule) -> list[int]:
    """Point-to-point messages each rank sends plus receives in one step, read off the action lists.

    Every dependency of an action on another rank's action is one message (an activation forward or a
    gradient back), which is exactly what the orchestrator sends. The shape headers, sent once per
    stage and micro-batch size, are not counted.
    """
    placement = placement_of(schedule)
    counts = [0] * len(schedule)
    for rank, actions in enumerate(schedule):
        for action in actions:
            for source, _ in dependencies(action, rank, placement):
                if source != rank:
                    counts[rank] += 1  # received here
                    counts[source] += 1  # sent there
    return counts


def _in_milliseconds(timeline: Timeline) -> Timeline:
    spans = [Span(s.rank, s.action, s.start * 1e3, s.end * 1e3, s.wait * 1e3) for s in timeline.spans]
    return Timeline(spans, timeline.num_ranks, timeline.chunks)
