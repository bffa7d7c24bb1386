"""The simulator and the timeline it produces."""

from __future__ import annotations

import pytest

from pipeclock.engine.actions import Action, parse_schedule
from pipeclock.engine.generators import gpipe, naive, one_f_one_b, zero_bubble_h1
from pipeclock.observe.simulate import DeadlockError, simulate
from pipeclock.observe.timeline import Span, Timeline


def times(timeline: Timeline, rank: int) -> list[tuple[str, float, float]]:
    return [(str(s.action), s.start, s.end) for s in timeline.spans_of(rank)]


# The simulator.


def test_each_action_starts_when_its_rank_is_free_and_its_inputs_exist():
    timeline = simulate(gpipe(2, 2))
    assert times(timeline, 0) == [("F0", 0, 1), ("F1", 1, 2), ("B0", 5, 7), ("B1", 7, 9)]
    assert times(timeline, 1) == [("F0", 1, 2), ("F1", 2, 3), ("B0", 3, 5), ("B1", 5, 7)]


def test_default_costs_are_f1_b2_or_f_b_w_1_when_split():
    assert [s.duration for s in simulate(naive(1, 1)).spans] == [1, 2]
    assert [s.duration for s in simulate(zero_bubble_h1(1, 1)).spans] == [1, 1, 1]


def test_costs_override_only_the_ops_they_name():
    timeline = simulate(gpipe(1, 2), costs={"B": 5})
    assert times(timeline, 0) == [("F0", 0, 1), ("F1", 1, 2), ("B0", 2, 7), ("B1", 7, 12)]


@pytest.mark.parametrize("p", [1, 2, 5])
def test_latency_is_paid_once_per_hop_between_ranks(p):
    # One micro-batch crosses p - 1 links down and p - 1 links back up.
    assert simulate(naive(p, 1), comm_latency=0.5).makespan == 3 * p + 2 * (p - 1) * 0.5


def test_latency_is_not_paid_within_a_rank():
    assert simulate(gpipe(1, 3), comm_latency=10).makespan == 9


def test_a_deadlock_names_every_stuck_rank_and_what_it_waits_for():
    crossed = parse_schedule(["F0 B0 F1 B1", "F1 B1 F0 B0"])
    with pytest.raises(DeadlockError) as caught:
        simulate(crossed)
    message = str(caught.value)
    assert "rank 0: stuck at B0 (action 1), waiting for B0 (or I0) on rank 1" in message
    assert "rank 1: stuck at F1 (action 0), waiting for F1 on rank 0" in message


def test_a_deadlock_report_lists_every_missing_input():
    backward_first = parse_schedule(["B0 F0", "F0 B0"])
    with pytest.raises(
        DeadlockError, match=r"rank 0: stuck at B0.*waiting for F0 on rank 0 and B0 \(or I0\) on rank 1"
    ):
        simulate(backward_first)


def test_a_deadlock_report_marks_finished_ranks():
    weight_before_backward = parse_schedule(["F0 W0 I0", "F0 I0 W0"])
    with pytest.raises(DeadlockError) as caught:
        simulate(weight_before_backward)
    assert str(caught.value).splitlines()[1:] == [
        "  rank 0: stuck at W0 (action 1), waiting for I0 on rank 0",
        "  rank 1: finished",
    ]


def test_a_deadlock_is_a_runtime_error():
    assert issubclass(DeadlockError, RuntimeError)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], "at least one rank"),
        ([*one_f_one_b(2, 2), []], "rank 2: missing"),
        (parse_schedule(["F0 F0 B0", "F0 B0"]), "F0 appears 2 times"),
        (parse_schedule(["F0 B0 F1 B1", "F0 B0"]), "rank 1: missing F1 B1"),
    ],
    ids=["no ranks", "a rank too many", "duplicate action", "missing micro-batch"],
)
def test_a_malformed_schedule_is_a_value_error(schedule, message):
    with pytest.raises(ValueError, match=message):
        simulate(schedule)


@pytest.mark.parametrize(
    ("costs", "latency", "message"),
    [({"F": -1}, 0.0, "cost of F"), ({"X": 1}, 0.0, "unknown op"), (None, -0.1, "comm_latency")],
)
def test_impossible_costs_are_a_value_error(costs, latency, message):
    with pytest.raises(ValueError, match=message):
        simulate(gpipe(2, 2), costs=costs, comm_latency=latency)


# The timeline's figures.


def span(rank: int, action: str, start: float, end: float, wait: float = 0.0) -> Span:
    return Span(rank, Action.parse(action), start, end, wait)


def test_makespan_runs_from_the_first_start_to_the_last_end():
    timeline = Timeline([span(0, "F0", 10, 11), span(1, "F0", 12, 13)], num_ranks=2)
    assert timeline.makespan == 3


def test_busy_time_excludes_communication_waits():
    timeline = Timeline([span(0, "F0", 0, 2, wait=0.5), span(0, "B0", 2, 4)], num_ranks=1)
    assert timeline.busy(0) == 3.5
    assert timeline.busy_fraction(0) == 3.5 / 4


def test_bubble_share_and_bubble_vs_ideal_of_a_small_pipeline():
    timeline = simulate(one_f_one_b(4, 8))  # 33 units; each rank computes 24
    assert timeline.bubble_share == pytest.approx(1 - 4 * 24 / (4 * 33))
    assert timeline.bubble_vs_ideal == pytest.approx((33 - 24) / 24)


def test_an_activation_is_freed_before_the_next_one_taken_at_the_same_instant():
    timeline = Timeline([span(0, "F0", 0, 1), span(0, "B0", 1, 2), span(0, "F1", 2, 3)], num_ranks=1)
    assert timeline.peak_live(0) == 1


def test_in_a_split_backward_an_activation_lives_until_its_w():
    spans = [span(0, "F0", 0, 1), span(0, "B0", 1, 2), span(0, "F1", 2, 3), span(0, "W0", 3, 4)]
    assert Timeline(spans, num_ranks=1).peak_live(0) == 2


def test_each_chunk_counts_for_a_fraction_of_a_stage():
    spans = [span(0, "F0", 0, 1), span(0, "F0.1", 1, 2), span(0, "F1", 2, 3)]
    assert Timeline(spans, num_ranks=1, chunks=2).peak_live(0) == 1.5


def test_a_span_outside_the_ranks_is_rejected():
    with pytest.raises(ValueError, match="does not fit"):
        Timeline([span(2, "F0", 0, 1)], num_ranks=2)


def test_the_chrome_trace_has_one_complete_event_per_span_in_microseconds():
    timeline = Timeline([span(1, "B2.1", 0.5, 1.5, wait=0.25)], num_ranks=2, chunks=2)
    events = [e for e in timeline.to_chrome_trace(time_unit_us=1e6)["traceEvents"] if e["ph"] == "X"]
    assert events == [
        {
            "name": "B2.1",
            "cat": "B",
            "ph": "X",
            "pid": 1,
            "tid": 0,
            "ts": 500000.0,
            "dur": 1000000.0,
            "args": {"microbatch": 2, "chunk": 1, "wait_us": 250000.0},
        }
    ]
