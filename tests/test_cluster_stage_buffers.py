"""torch's pipelining of December 2024 on torchtitan's 405B rows (`benchmarks.stage_buffers`: a reading, not yet
part of the planner): walked action by action, the gradients arriving at
each stage's first backward leave a rank with one stage as the planner counts it and lower a rank with
two; the stages' kept outputs and receive buffers lift every fullest rank."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks.published_2024 import titan_rows
from benchmarks.stage_buffers import GIB, peaks
from pipeclock.plan.search import search

pytestmark = pytest.mark.long  # ~8 s: transformers' configs, then two searches and their walks


@pytest.fixture(scope="module")
def table5() -> dict:
    found = {}
    for row in titan_rows():
        if row.source == "torchtitan T5":
            best = search(row.model, row.cluster, row.job, row.software, row.fixed, top=1).ranked[0]
            walks = [max(peaks(row.model, best.config, row.job, row.software, b)) for b in (False, True)]
            found[row.name] = (row.memory, best.memory.total / GIB, *walks)
    return found


def test_one_stage_a_rank_walks_to_the_planners_count(table5):
    _, planner, walked, _ = table5["1F1B"]
    assert walked == pytest.approx(planner, rel=1e-3)


def test_two_stages_a_rank_hold_less_than_everything_at_once(table5):
    _, planner, walked, _ = table5["Interleaved 1F1B"]
    assert planner - walked > 4.0


def test_the_buffers_bring_both_schedules_within_ten_percent(table5):
    one, interleaved = table5["1F1B"], table5["Interleaved 1F1B"]
    assert abs(one[3] / one[0] - 1) < 0.10 < abs(one[1] / one[0] - 1)
    assert abs(interleaved[3] / interleaved[0] - 1) < 0.10
