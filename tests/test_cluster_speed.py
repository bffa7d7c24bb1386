"""The planner's shortcuts to a simulated step give the full computation's answers: the engine's own
simulator on the lowered program, on every schedule the search uses, at small sizes, with unequal stage
costs, messages and expert parallel's all-to-alls."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from pipeclock.engine.actions import placement_of
from pipeclock.engine.generators import SCHEDULES, generate
from pipeclock.plan.cluster_config import Job, Software
from pipeclock.plan.cluster_memory import gpu_memory, memory_floor, placement_for, static_floor
from pipeclock.plan.cluster_time import Rates, optimizer_seconds, step_time, work_floor
from pipeclock.plan.gpus import KINDS, Cluster
from pipeclock.plan.paper_model import PaperModel, mlp_model
from pipeclock.plan.pipeline_replay import compiled, replay
from pipeclock.plan.pipeline_time import engine_simulated
from pipeclock.plan.search import SearchError, config_groups, configurations, floor_of, group_floors, search

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
    for pp in (1, 2, 3, 5):
        for microbatches in (1, 2, 5, 11):
            for chunks in CHUNKS.get(schedule, (1,)):
                for exchanging in (False, True):
                    costs = stage_costs(pp * chunks, rng, exchanging)
                    transfer = rng.choice((0.0, 0.1, 0.7))
                    shape = (schedule, pp, microbatches, chunks)
                    expected = engine_simulated(*shape, costs, transfer)
                    run = replay(compiled(*shape), costs, transfer)
                    assert (run.makespan, run.moments) == (expected.makespan, expected.moments), shape
                    assert run.bubble == pytest.approx(expected.bubble, rel=1e-9, abs=1e-12)


MOE = PaperModel("test MoE", layers=8, hidden=1024, heads=8, kv_heads=8, head_dim=128, ffn=2048, vocab=32000,
                 experts=8, experts_per_token=2)  # fmt: skip
DENSE = PaperModel("test 1.2B", layers=16, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632,
                   vocab=32000)  # fmt: skip


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_the_search_floors_each_group_once_as_it_would_each_configuration(model):
    """A search computes the cheap floors (and the optimizer's seconds) once for all schedules of a
    configuration: the groups hold every configuration, in order, and these are equal within each; each
    member's schedule floor, computed with what its group shares, is its floor computed alone."""
    cluster, job, software = Cluster(16, KINDS["H100-80GB"]), Job(64, 2048), Software("bf16")
    rates = Rates(cluster.kind, software)
    grouped = {}
    for base, members in config_groups(model, cluster, job, {}):
        floors = set()
        for schedule, chunks, number in members:
            config = replace(base, schedule=schedule, chunks=chunks)
            grouped[number] = config
            floors.add((
                static_floor(model, config, software),
                work_floor(model, config, job, software, rates),
                optimizer_seconds(model, config, rates),
            ))  # fmt: skip
        assert len(floors) == 1, base
        for schedule, chunks, _, floor in group_floors(model, base, members, job, software, rates):
            config = replace(base, schedule=schedule, chunks=chunks)
            assert floor == floor_of(model, config, job, software, rates), config
    assert [grouped[n] for n in sorted(grouped)] == list(configurations(model, cluster, job, {}))


def test_a_search_leaves_the_garbage_collector_as_it_found_it():
    import gc

    cluster, job = Cluster(8, KINDS["H100-80GB"]), Job(16, 1024)
    assert gc.isenabled()
    search(DENSE, cluster, job, Software("bf16"), top=1)
    assert gc.isenabled()
    with pytest.raises(SearchError):
        search(DENSE, cluster, job, Software("bf16"), {"tp": 16}, top=1)
    assert gc.isenabled()


def test_a_schedules_placement_is_read_without_generating_it_as_the_generator_places_it():
    for schedule in SCHEDULES:
        for pp in (1, 2, 3, 5):
            for chunks in CHUNKS.get(schedule, (1,)):
                expected = placement_of(generate(schedule, pp, 1, chunks))
                assert placement_for(schedule, pp, chunks) == expected, (schedule, pp, chunks)


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_the_memory_floor_never_exceeds_the_memory_a_configuration_takes(model):
    """A search rejects a configuration whose `memory_floor` is over the GPU without reading its
    schedule: the floor must be under the judged memory, on every configuration."""
    cluster, job = Cluster(8, KINDS["H100-80GB"]), Job(16, 4096)
    for software in (Software("bf16"), Software("fp8", True, False)):
        for config in itertools.islice(configurations(model, cluster, job, {}), 0, None, 3):
            floor = memory_floor(model, config, job, software)
            assert floor <= gpu_memory(model, config, job, software).total, config


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_the_time_floors_never_exceed_the_step_a_configuration_takes(model):
    """A search drops a configuration whose floor is above the best step found: each floor must be
    under the simulated step (whose costs are rounded), here on every other configuration of the
    space, or the best could be the one dropped."""
    cluster, job = Cluster(8, KINDS["H100-80GB"]), Job(16, 4096)
    for software in (Software("bf16"), Software("fp8", True, False)):
        rates = Rates(cluster.kind, software)
        for config in itertools.islice(configurations(model, cluster, job, {}), 0, None, 2):
            step = step_time(model, config, job, software, cluster.kind).step
            assert work_floor(model, config, job, software, rates) <= step, config
            assert floor_of(model, config, job, software, rates) <= step, config


TIED = mlp_model(10**10, 16)  # on 8 RTX4090s at tp 4, recompute none and full take the same step to the bit


@pytest.mark.parametrize(
    "model, cluster, job",
    [
        (DENSE, Cluster(16, KINDS["H100-80GB"]), Job(64, 2048)),
        (MOE, Cluster(16, KINDS["H100-80GB"]), Job(64, 2048)),
        (TIED, Cluster(8, KINDS["RTX4090"]), Job(128, 1)),
    ],
    ids=["dense", "moe", "tied"],
)
def test_the_ranked_rows_do_not_depend_on_how_tight_the_floors_are(model, cluster, job, monkeypatch):
    """Looser floors judge more configurations and must rank the same ones, equal steps in the order
    the knobs enumerate them."""
    import pipeclock.plan.pipeline_time

    ranked = []
    for rounding in (0.005, 0.2):
        monkeypatch.setattr(pipeclock.plan.pipeline_time, "ROUNDING", rounding)
        found = search(model, cluster, job, Software("bf16"), top=8)
        ranked.append(([(p.config, p.time.step) for p in found.ranked], found.judged))
    (tight, judged_tight), (loose, judged_loose) = ranked
    assert judged_loose > judged_tight
    assert loose == tight


def test_a_search_where_nothing_fits_names_the_closest_it_judged():
    """Where every configuration judged is too large, the closest is the one with the least memory, as
    judging each on its own finds."""
    cluster, job, software = (
        Cluster(4, replace(KINDS["H100-80GB"], memory=5 * 2**30)),
        Job(8, 4096),
        Software("bf16"),
    )
    found = search(DENSE, cluster, job, software, top=1)
    assert not found.ranked and found.judged
    every = [
        gpu_memory(DENSE, config, job, software).total for config in configurations(DENSE, cluster, job, {})
    ]
    assert found.smallest.memory.total == min(every)


def test_a_models_hash_is_its_fields_and_another_process_computes_its_own():
    import pickle

    twin = replace(DENSE, name=DENSE.name)
    assert hash(DENSE) == hash(twin) and twin == DENSE and {DENSE: 1}[twin] == 1
    assert hash(replace(DENSE, layers=17)) != hash(DENSE)
    assert "_hash" not in pickle.loads(pickle.dumps(DENSE)).__dict__
