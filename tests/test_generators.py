"""The schedule generators: what every schedule guarantees, and exact tables for small cases."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeclock.engine.actions import is_split, join_first_stage_backwards, parse_schedule, validate
from pipeclock.engine.generators import (
    SCHEDULES,
    V_SCHEDULES,
    bubble_formula,
    bubble_formula_text,
    chunks_of,
    generate,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    naive,
    one_f_one_b,
    supports_chunks,
    zero_bubble_h1,
)
from pipeclock.observe.simulate import simulate

stages = st.integers(1, 8)
microbatches = st.integers(1, 16)
chunk_counts = st.integers(1, 4)
properties = settings(max_examples=100, deadline=None)


def chunks_for(name: str, chunks: int) -> int:
    return chunks_of(name) or (chunks if supports_chunks(get_schedule(name)) else 1)


# Properties of every schedule, for every p <= 8, m <= 16, chunks <= 4.


@pytest.mark.parametrize("name", SCHEDULES)
@properties
@given(p=stages, m=microbatches, chunks=chunk_counts)
def test_every_schedule_computes_each_stage_and_microbatch_exactly_once(name, p, m, chunks):
    chunks = chunks_for(name, chunks)
    schedule = generate(name, p, m, chunks)
    validate(schedule, p, m, chunks)
    if name != "dualpipev":  # it mixes whole and split backwards (tests/test_v_schedules.py)
        assert is_split(schedule) == (name in ("zb-h1", "zb-v"))


@pytest.mark.parametrize("name", SCHEDULES)
@properties
@given(p=stages, m=microbatches, chunks=chunk_counts)
def test_every_schedule_finishes_without_deadlock(name, p, m, chunks):
    timeline = simulate(generate(name, p, m, chunks_for(name, chunks)))
    assert timeline.makespan > 0


@pytest.mark.parametrize("name", SCHEDULES)
@properties
@given(p=stages, m=microbatches, chunks=chunk_counts)
def test_every_rank_runs_each_channel_in_microbatch_order(name, p, m, chunks):
    chunks = chunks_for(name, chunks)
    for actions in generate(name, p, m, chunks):
        for ops in ("F", "BI", "W"):  # a channel's backwards, whole or split, in one order
            for chunk in range(chunks):
                order = [a.microbatch for a in actions if a.op in ops and a.chunk == chunk]
                assert order == sorted(order)


# Makespans with unit costs (F=1, B=2; F=B=W=1 when split) equal the textbook formulas.


@properties
@given(p=stages, m=microbatches)
def test_naive_takes_3mp_because_one_microbatch_crosses_the_pipe_at_a_time(p, m):
    assert simulate(naive(p, m)).makespan == 3 * m * p


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
@properties
@given(p=stages, m=microbatches)
def test_gpipe_and_1f1b_take_3_times_m_plus_p_minus_1(generator, p, m):
    assert simulate(generator(p, m)).makespan == 3 * (m + p - 1)


@properties
@given(p=stages, rounds=st.integers(1, 16), chunks=chunk_counts)
def test_interleaved_takes_3_times_mv_plus_p_minus_1_per_chunk_when_p_divides_m(p, rounds, chunks):
    m = p * min(rounds, 16 // p)
    assert simulate(interleaved_1f1b(p, m, chunks)).makespan == 3 * (m * chunks + p - 1)


@properties
@given(p=stages, m=microbatches)
def test_zb_h1_takes_3m_plus_p_minus_1_when_m_is_at_least_p(p, m):
    m = max(m, p)
    assert simulate(zero_bubble_h1(p, m)).makespan == 3 * m + p - 1


@pytest.mark.parametrize("name", SCHEDULES)
@properties
@given(p=stages, rounds=st.integers(1, 16), chunks=chunk_counts)
def test_simulated_bubble_equals_the_formula_where_its_assumptions_hold(name, p, rounds, chunks):
    m = p * min(rounds, 16 // p)  # p divides m and m >= p
    if name in V_SCHEDULES:
        m = 2 * p * max(1, min(rounds, 16 // (2 * p)))  # a V reaches its steady state at m >= 2p
    chunks = chunks_for(name, chunks)
    timeline = simulate(generate(name, p, m, chunks))
    assert timeline.bubble_share == pytest.approx(bubble_formula(name, p, m, chunks))


# Activation memory.


@properties
@given(p=stages, m=microbatches)
def test_naive_holds_one_microbatch_at_a_time(p, m):
    timeline = simulate(naive(p, m))
    assert [timeline.peak_live(r) for r in range(p)] == [1] * p


@properties
@given(p=stages, m=microbatches)
def test_gpipe_holds_all_m_microbatches_on_every_rank(p, m):
    timeline = simulate(gpipe(p, m))
    assert [timeline.peak_live(r) for r in range(p)] == [m] * p


@properties
@given(p=stages, m=microbatches)
def test_1f1b_rank_r_holds_at_most_min_m_and_p_minus_r(p, m):
    timeline = simulate(one_f_one_b(p, m))
    assert [timeline.peak_live(r) for r in range(p)] == [min(m, p - r) for r in range(p)]


@properties
@given(p=stages, m=microbatches)
def test_zb_h1_never_holds_more_than_p_microbatches_until_their_w(p, m):
    timeline = simulate(zero_bubble_h1(p, m))
    assert max(timeline.peak_live(r) for r in range(p)) <= p


@properties
@given(p=stages, m=microbatches)
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    assert interleaved_1f1b(p, m, 1) == one_f_one_b(p, m)


# Golden tables, written from the rules.


def test_naive_alternates_forward_and_backward():
    assert naive(2, 2) == parse_schedule(["F0 B0 F1 B1", "F0 B0 F1 B1"])


def test_gpipe_p2_m3_fills_then_drains():
    assert gpipe(2, 3) == parse_schedule(["F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"])


def test_1f1b_p4_m8_warms_up_p_minus_r_minus_1_forwards():
    assert one_f_one_b(4, 8) == parse_schedule(
        [
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
            "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
        ]
    )


def test_1f1b_with_fewer_microbatches_than_stages_is_gpipe_on_the_early_ranks():
    assert one_f_one_b(4, 2) == parse_schedule(["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"])


def test_zb_h1_p3_m4_runs_w_of_j_after_i_of_j_plus_r():
    assert zero_bubble_h1(3, 4) == parse_schedule(
        [
            "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
            "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
            "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
        ]
    )


def test_the_engine_runs_a_first_stage_i_and_the_w_right_after_it_as_one_b():
    # Stage 0 sends no gradient, so nothing waits for its I: where its W comes next, they are one B.
    # Rank 0 of ZB-H1 then runs what 1F1B runs; the later ranks keep their split.
    joined = join_first_stage_backwards(zero_bubble_h1(3, 4))
    assert joined == parse_schedule(
        [
            "F0 F1 F2 B0 F3 B1 B2 B3",
            "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
            "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
        ]
    )
    assert joined[0] == one_f_one_b(3, 4)[0]
    validate(joined, 3, 4)


def test_on_a_v_only_the_first_stages_backward_is_joined():
    # Rank 0 holds stage 0 (chunk 0) and the last stage (chunk 1), whose I's gradient goes on to rank 1.
    v = generate("zb-v", 2, 1, 2)
    assert [str(a) for a in v[0]] == ["F0", "F0.1", "I0.1", "W0.1", "I0", "W0"]
    joined = join_first_stage_backwards(v)
    assert [str(a) for a in joined[0]] == ["F0", "F0.1", "I0.1", "W0.1", "B0"]
    assert joined[1] == v[1] and joined.placement == v.placement
    assert simulate(joined).makespan <= simulate(v).makespan


def test_interleaved_p2_m4_two_chunks_follows_megatrons_rounds():
    # Warm-up: rank 0 does 2*1 + 1*2 = 4 forwards, rank 1 does 0 + 2 = 2.
    assert interleaved_1f1b(2, 4, 2) == parse_schedule(
        [
            "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
            "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
        ]
    )


def test_interleaved_with_a_short_last_round_drops_the_padding_microbatches():
    # The m=4 table above without micro-batch 3.
    assert interleaved_1f1b(2, 3, 2) == parse_schedule(
        [
            "F0 F1 F0.1 F1.1 F2 B0.1 B1.1 F2.1 B0 B1 B2.1 B2",
            "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 B1 F2.1 B2.1 B2",
        ]
    )


def test_interleaved_never_deadlocks_for_any_p_up_to_8_m_up_to_16_chunks_up_to_4():
    # Exhaustive, because the warm-up formula alone deadlocks for a few short last rounds (p=5, m=7).
    for p, m, chunks in itertools.product(range(1, 9), range(1, 17), range(2, 5)):
        simulate(interleaved_1f1b(p, m, chunks))


def test_zb_h1_p3_m4_has_a_third_of_the_1f1b_bubble():
    assert simulate(zero_bubble_h1(3, 4)).makespan == 14
    assert simulate(one_f_one_b(3, 4)).makespan == 18


# Looking schedules up by name.


def test_schedules_are_known_by_their_command_line_names():
    assert list(SCHEDULES) == ["naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"]
    assert get_schedule("1f1b") is one_f_one_b


def test_an_unknown_name_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'.*naive, gpipe, 1f1b"):
        get_schedule("pipedream")


def test_only_interleaved_takes_chunks():
    assert [name for name, gen in SCHEDULES.items() if supports_chunks(gen)] == ["interleaved-1f1b"]


def test_generate_calls_any_generator_the_same_way():
    assert generate("gpipe", 2, 3) == gpipe(2, 3)
    assert generate(interleaved_1f1b, 2, 4, chunks=2) == interleaved_1f1b(2, 4, 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("gpipe", 2, 3, 2), "one chunk per rank"),
        (("1f1b", 0, 3), "stages"),
        (("1f1b", 2, 0), "micro-batches"),
        (("interleaved-1f1b", 2, 3, 0), "chunks"),
    ],
)
def test_generate_rejects_impossible_requests(args, message):
    with pytest.raises(ValueError, match=message):
        generate(*args)


def test_bubble_formulas_are_the_textbook_ones():
    assert bubble_formula("naive", 4, 8) == pytest.approx(3 / 4)
    assert bubble_formula("gpipe", 4, 8) == bubble_formula("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_formula("interleaved-1f1b", 4, 8, chunks=2) == pytest.approx(3 / 19)
    assert bubble_formula("zb-h1", 4, 8) == pytest.approx(3 / 27)
    assert bubble_formula_text("1f1b") == "(p-1)/(m+p-1)"
    assert bubble_formula_text("interleaved-1f1b") == "(p-1)/(v*m+p-1)"
