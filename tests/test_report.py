"""What a run prints at its end and what its picture shows are the same step's figures."""

from __future__ import annotations

import re

from pipeclock.engine.generators import one_f_one_b
from pipeclock.engine.orchestrator import StepRecord
from pipeclock.observe.metrics import RankRun, RunReport
from pipeclock.observe.report import median_step, predicted_timeline, runs_figure, summary_lines
from pipeclock.observe.simulate import Link, simulate
from pipeclock.observe.timeline import Span
from pipeclock.training.loop import TrainConfig, schedule_table

SCHEDULE = one_f_one_b(2, 4)


def recorded_run(steps: list[tuple[float, float, float]]) -> RunReport:
    """Two ranks' records of 1F1B steps: for each step (seconds per simulator unit, an idle gap in the
    middle of rank 1's step, the step call's overhead beyond the last action), the simulator's spans,
    stretched, each step starting where the last one's call ended."""
    records: list[list[StepRecord]] = [[], []]
    clock = 100.0
    for unit, gap, overhead in steps:
        spans = [
            Span(s.rank, s.action, clock + s.start * unit, clock + s.end * unit)
            for s in simulate(SCHEDULE).spans
        ]
        middle = clock + 6 * unit
        spans = [
            Span(s.rank, s.action, s.start + gap, s.end + gap) if s.rank == 1 and s.start >= middle else s
            for s in spans
        ]
        end = max(s.end for s in spans)
        for rank in (0, 1):
            mine = [s for s in spans if s.rank == rank]
            records[rank].append(StepRecord(1.0, end - clock + overhead, mine, 1024))
        clock = end + overhead
    return RunReport([RankRun(rank, records[rank], 50.0, 2**28) for rank in (0, 1)])


# a warm-up, then three steps: the median step is the first measured one, and its bubble is not the mean
RUN = [(0.004, 0.0, 0.002), (0.001, 0.004, 0.0005), (0.0011, 0.0, 0.0003), (0.0009, 0.008, 0.0008)]


def figures(text: str) -> dict[str, str]:
    """The step time, makespan and bubble named in a printed line or a picture's title."""
    found = {
        "step time": re.search(r"step time\s+([\d.]+ ms)", text),
        "makespan": re.search(r"makespan (?:\()?([\d.]+ ms)", text),
        "bubble": re.search(r"(?:measured |bubble )([\d.]+%)", text),
        "which": re.search(r"(the median of \d+ steps)", text),
    }
    return {name: match.group(1) for name, match in found.items() if match}


def test_the_summary_and_the_picture_quote_the_same_median_step():
    report = recorded_run(RUN)
    step = median_step(report)
    assert step.count == 3 and step.timeline is report.measured[0]
    mean = sum(t.bubble_share for t in report.measured) / len(report.measured)
    assert round(step.timeline.bubble_share, 3) != round(mean, 3), "the mean is another figure"
    assert report.bubble_share == step.timeline.bubble_share, "the report's headline bubble is that step's"
    assert report.step_seconds == step.seconds and report.busy_fraction(1) == step.timeline.busy_fraction(1)
    printed = "\n".join(summary_lines(report, "1f1b", SCHEDULE, batch_size=32))
    figure = runs_figure([("1f1b", report, SCHEDULE)])
    predicted, measured = (axes.get_title(loc="left") for axes in figure.axes)
    said = figures(printed)
    assert len(said) == 4, printed
    assert said == figures(measured), f"{printed}\n---\n{measured}"
    assert said["step time"] == f"{step.seconds * 1e3:.2f} ms"
    assert said["bubble"] == f"{step.timeline.bubble_share:.1%}"
    simulated = re.search(r"simulated with the measured op times ([\d.]+%)", printed).group(1)
    assert f"bubble {simulated}" in predicted
    assert figure.axes[-1].get_xlabel() == "time (ms)"
    assert median_step(recorded_run(RUN[:2])).which == "the one measured step"
    busy = [float(share) / 100 for share in re.findall(r"^\s+[01]\s+([\d.]+)%", printed, re.MULTILINE)]
    assert abs(1 - sum(busy) / 2 - step.timeline.bubble_share) < 0.001, (
        "the ranks' busy shares are that step's"
    )


def test_a_prediction_charges_each_message_the_link_and_the_bytes_the_run_sent():
    report = recorded_run([(0.001, 0.0, 0.0), (0.001, 0.0, 0.0)])
    for run in report.ranks:
        for record in run.steps:
            record.sent_bytes = 4 * 2**20  # 1F1B p = 2, m = 4: each rank sends 4 messages of 1 MiB
    free = predicted_timeline(report, SCHEDULE)
    linked = predicted_timeline(report, SCHEDULE, Link(latency=0.001, bandwidth=2**20 / 0.002))
    assert linked.makespan > free.makespan + 2 * 0.003  # the first activation and the last gradient
    assert linked.spans_of(1)[0].start == free.spans_of(1)[0].start + 0.003
    printed = "\n".join(
        summary_lines(report, "1f1b", SCHEDULE, 32, Link(latency=0.001, bandwidth=2**20 / 0.002))
    )
    said = f"simulated with the measured op times {linked.bubble_share:.1%} (each message 1000 us + its bytes"
    assert said in printed


def test_a_prediction_simulates_the_actions_the_engine_ran():
    # On one process every ZB-H1 backward is a first-stage I with its W right after: the engine runs B's,
    # so the prediction must too (simulating I and W would price them at the unmeasured default, 1 s).
    alone = schedule_table(TrainConfig(schedule="zb-h1", microbatches=4), 1)
    assert [str(a) for a in alone[0]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    two = schedule_table(TrainConfig(schedule="zb-h1", microbatches=4), 2)
    assert {a.op for a in two[0]} == {"F", "B"} and {a.op for a in two[1]} == {"F", "I", "W"}


def test_steps_profiled_for_tps_collectives_are_reported_beside_the_step_and_left_out_of_the_rest():
    # step 4 is the fastest: with it and step 2 profiled, the median is another step
    report = recorded_run([*RUN, (0.0004, 0.0, 0.0001), (0.0010, 0.002, 0.0004)])
    plain = "\n".join(summary_lines(report, "1f1b", SCHEDULE, batch_size=32))
    assert "tensor parallel" not in plain and "tp coll" not in plain, "no profiled step, nothing new"
    untimed_median = report.median_index
    for step, (inside, calls) in {2: (0.0002, 14), 4: (0.0004, 16)}.items():
        for run in report.ranks:
            run.steps[step].collective_seconds, run.steps[step].collective_calls = inside, calls
    assert report.timed_steps == [2, 4] and report.measured_steps == [1, 3, 5]
    assert report.median_index in (1, 3, 5) and report.median_index != untimed_median
    assert median_step(report).count == 3
    printed = summary_lines(report, "1f1b", SCHEDULE, batch_size=32)
    line = next(line for line in printed if line.startswith("tensor parallel"))
    call = (report.ranks[0].steps[2].seconds + report.ranks[0].steps[4].seconds) / 2
    share = (0.0002 / report.ranks[0].steps[2].seconds + 0.0004 / report.ranks[0].steps[4].seconds) / 2
    assert line.startswith(
        f"tensor parallel  inside its collectives 0.30 ms of each rank's {call * 1e3:.2f} ms step call "
        f"({share:.1%}; 14 to 16 calls a rank), means over 2 step(s) profiled for it"
    ), line
    header = printed.index(next(line for line in printed if line.startswith("rank ")))
    assert printed[header].endswith("   tp coll")
    for rank, row in enumerate(printed[header + 1 : header + 3]):
        steps = report.ranks[rank].steps
        mine = (0.0002 / steps[2].seconds + 0.0004 / steps[4].seconds) / 2
        assert row.endswith(f"{mine:7.1%}"), (rank, row)
