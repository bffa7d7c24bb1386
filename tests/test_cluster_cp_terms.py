"""torchtitan's 405B context-parallel rows (Table 6) term by term (`benchmarks.cp_terms`; the argument is
docs/cluster.md's): which of the planner's terms could close their gap with one multiple, and which
cannot."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks.cluster_check import rows
from benchmarks.cp_terms import SERIES, TERMS, split

pytestmark = pytest.mark.long  # ~8 s: transformers' configs, then four searches


@pytest.fixture(scope="module")
def series() -> list:
    return sorted((split(row) for row in rows() if row.source == SERIES), key=lambda s: s.cp)


def test_the_terms_add_up_to_the_step_and_the_pipeline_runs_about_m_plus_pp_minus_1_stage_times(series):
    for each in series:
        assert sum(each.seconds[t] for t in TERMS) == pytest.approx(each.step, rel=1e-9)
        assert 14.0 < each.critical <= 15.0  # 1F1B, 8 micro-batches through 8 stages: 15 less the ends
        assert each.seconds["ends and messages"] > 0


def test_the_data_parallel_exchange_and_the_messages_cannot_be_what_grows_with_cp(series):
    for each in series:
        assert each.seconds["dp"] + each.seconds["ends and messages"] < 0.002 * each.step


def test_attention_would_need_a_different_multiple_at_each_cp(series):
    multiples = [each.multiple("attention") for each in series]
    assert multiples[0] < 1 < min(multiples[1:])  # cp 1 wants it cheaper, the others dearer
    assert max(multiples) - min(multiples) > 0.4


def test_the_exchange_would_need_more_than_three_times_what_the_planner_leaves_exposed(series):
    assert all(3.0 < each.multiple("exchange") < 4.0 for each in series[1:])
