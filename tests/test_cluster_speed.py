"""The planner's shortcuts to a simulated step give the full computation's answers: the engine's own
simulator on the lowered program, on every schedule the search uses, at small sizes, with unequal stage
costs, messages and expert parallel's all-to-alls."""

from __future__ import annotations

import random

import pytest

from pipeclock.engine.generators import SCHEDULES
from pipeclock.plan.pipeline_replay import compiled, replay
from pipeclock.plan.pipeline_time import engine_simulated

CHUNKS = {"interleaved-1f1b": (2, 3), "zb-v": (2,), "dualpipev": (2,)}


def stage_costs(stages: int, rng: random.Random, exchanging: bool) -> tuple:
    """Per stage (F, B, I, W, the all-to-alls inside F and inside B or I), each different."""
    costs = []
    for _ in range(stages):
        forward, input_grad, weight_grad = rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.2, 1)
        inside = (rng.uniform(0, forward), rng.uniform(0, input_grad)) if exchanging else (0.0, 0.0)
        costs.append((forward, input_grad + weight_grad, input_grad, weight_grad, *inside))
    return tuple(costs)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_compiled_program_times_every_action_as_the_engine_simulator_does(schedule):
    rng = random.Random(schedule)
    for pp in (1, 2, 3, 4, 5):
        for microbatches in (1, 2, 3, 5, 8, 11):
            for chunks in CHUNKS.get(schedule, (1,)):
                for exchanging in (False, True):
                    costs = stage_costs(pp * chunks, rng, exchanging)
                    transfer = rng.choice((0.0, 0.1, 0.7))
                    shape = (schedule, pp, microbatches, chunks)
                    expected = engine_simulated(*shape, costs, transfer)
                    run = replay(compiled(*shape), costs, transfer)
                    assert (run.makespan, run.moments) == (expected.makespan, expected.moments), shape
                    assert run.bubble == pytest.approx(expected.bubble, rel=1e-9, abs=1e-12)
