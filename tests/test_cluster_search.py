"""The cluster planner's search: it keeps its promises (fit, fixed knobs, the best found), its bubble is the
program simulator's, and its pruning never drops a configuration that could win."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pipeclock.engine.actions import join_first_stage_backwards, placement_of
from pipeclock.engine.generators import SCHEDULES, generate
from pipeclock.observe.simulate import simulate
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import gpu_memory
from pipeclock.plan.cluster_plan import predict
from pipeclock.plan.cluster_time import Rates, message_seconds, stage_costs, step_time
from pipeclock.plan.gpus import KINDS, Cluster
from pipeclock.plan.paper_model import PaperModel
from pipeclock.plan.pipeline_time import pipeline_floor
from pipeclock.plan.search import SearchError, configurations, search

# a 1.2B Llama-shaped model: small enough that every search here takes a fraction of a second
MODEL = PaperModel("test 1.2B", layers=16, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632,
                   vocab=32000)  # fmt: skip
SOFTWARE = Software("bf16")


def cluster(count: int, kind: str = "H100-80GB", memory_gib: float | None = None) -> Cluster:
    gpu = KINDS[kind]
    if memory_gib is not None:
        from dataclasses import replace

        gpu = replace(gpu, memory=int(memory_gib * 2**30))
    return Cluster(count, gpu)


def test_the_search_returns_only_configurations_that_fit_best_first():
    tight = cluster(16, memory_gib=9)  # some layouts fit, many do not
    job = Job(64, 2048)
    found = search(MODEL, tight, job, SOFTWARE, top=8)
    assert found.ranked and found.fitting < found.considered
    steps = [p.time.step for p in found.ranked]
    assert steps == sorted(steps)
    for p in found.ranked:
        assert p.fits and p.memory.total <= tight.kind.memory
        assert gpu_memory(MODEL, p.config, job, SOFTWARE) == p.memory  # judged as on its own


def test_a_pruned_search_finds_the_best_that_judging_every_configuration_finds():
    small = cluster(4, memory_gib=12)
    job = Job(8, 1024)
    found = search(MODEL, small, job, SOFTWARE, top=1)
    every = [predict(MODEL, c, job, SOFTWARE, small) for c in configurations(MODEL, small, job, {})]
    fastest = min((p for p in every if p.fits), key=lambda p: p.time.step)
    assert found.ranked[0].time.step == pytest.approx(fastest.time.step, rel=1e-12)
    assert found.simulated < len(every) / 10  # and it simulated a small share of them


def _deepseek_v3() -> tuple:
    from pipeclock.plan.gpus import load_spec, parse_cluster
    from pipeclock.plan.hf_paper import paper_model, read_config

    model = paper_model(read_config("docs/cluster/deepseek-v3.json"), "DeepSeek-V3")
    return model, parse_cluster("2048xH800", load_spec("docs/cluster/h800.json")), Job(15360, 4096)


def test_the_cheap_floor_leaves_out_the_all_to_alls_a_dualpipev_step_hides():
    from pipeclock.plan.cluster_time import work_floor

    model, h800s, job = _deepseek_v3()
    software = Software("fp8", fused=True)
    config = Config(1, 16, 128, "dualpipev", 2, 1, 120, "selective-op", 1, False, 16)
    step = predict(model, config, job, software, h800s).time.step
    assert work_floor(model, config, job, software, Rates(h800s.kind, software)) <= step


def test_costs_cached_for_one_expert_parallel_degree_are_not_read_for_another():
    model, h800s, job = _deepseek_v3()
    software = Software("fp8", fused=True)
    config = Config(1, 16, 128, "dualpipev", 2, 1, 120, "selective-op", 1, False, 16)
    shared = Rates(h800s.kind, software)
    stage_costs(model, replace(config, ep=1), job, software, shared)  # ep 1 first: no all-to-all
    assert stage_costs(model, config, job, software, shared) == stage_costs(
        model, config, job, software, Rates(h800s.kind, software)
    )


@pytest.mark.parametrize(
    "fixed",
    [
        {"tp": 2, "pp": 4},
        {"tp": 1, "pp": 2, "dp": 8, "schedule": "zb-h1", "microbatch-size": 2},
        {"pp": 4, "schedule": "interleaved-1f1b", "chunks": 2, "recompute": "full", "zero": 1},
        {"tp": 4, "sp": True, "recompute": "selective-op", "zero": 3},
        {"pp": 2, "schedule": "dualpipev"},
        {"pp": 4, "schedule": "interleaved-1f1b", "chunks": 2, "ends": "slot"},
    ],
)
def test_fix_honours_every_fixed_knob(fixed):
    found = search(MODEL, cluster(16), Job(64, 2048), SOFTWARE, fixed, top=1)
    config = found.ranked[0].config
    names = {"microbatch-size": "microbatch_size", "sp": "sequence_parallel"}
    assert all(getattr(config, names.get(k, k)) == v for k, v in fixed.items())
    assert config.gpus == 16


@pytest.mark.parametrize(
    ("fixed", "message"),
    [
        ({"tp": 16}, "more than the 8 GPUs of one H100-80GB node"),
        ({"pp": 17}, "more than the model's 16 layers"),
        ({"tp": 2, "pp": 2, "dp": 2}, "= 8, not the cluster's 16 GPUs"),
        ({"tp": 3}, "does not divide the cluster's 16 GPUs"),
        ({"schedule": "1f1b", "chunks": 2}, "needs an interleaved schedule"),
    ],
)
def test_a_fix_that_cannot_work_is_refused_naming_the_knob(fixed, message):
    with pytest.raises(SearchError, match=message):
        search(MODEL, cluster(16), Job(64, 2048), SOFTWARE, fixed)


def test_a_global_batch_no_replica_count_divides_is_refused():
    with pytest.raises(SearchError, match="no dp x m divides --global-batch 7"):
        search(MODEL, cluster(16384), Job(7, 2048), SOFTWARE)


def _config(schedule: str, pp: int, m: int, chunks: int) -> Config:
    return Config(tp=1, pp=pp, dp=1, schedule=schedule, chunks=chunks, microbatch_size=1, microbatches=m,
                  recompute="none", zero=0, sequence_parallel=False)  # fmt: skip


CASES = [
    (name, pp, m, 2 if name in ("interleaved-1f1b", "zb-v", "dualpipev") else 1)
    for name, (pp, m) in itertools.product(SCHEDULES, [(2, 3), (4, 8), (4, 5), (4, 2), (3, 7)])
]


@pytest.mark.parametrize(("schedule", "pp", "m", "chunks"), CASES)
def test_the_bubble_is_the_program_simulators_and_the_floor_stays_under_it(schedule, pp, m, chunks):
    config = _config(schedule, pp, m, chunks)
    job, gpu = Job(m, 4096), KINDS["H100-80GB"]
    rates = Rates(gpu, SOFTWARE)
    costs = stage_costs(MODEL, config, job, SOFTWARE, rates)  # the ends make the stages unequal
    transfer = message_seconds(MODEL, config, job, rates)
    table = generate(schedule, pp, m, chunks)
    placement = placement_of(table)
    timeline = simulate(
        join_first_stage_backwards(table),
        lambda rank, action: costs[placement.stage(rank, action.chunk)][action.op],
        comm_latency=transfer,
    )
    planned = step_time(MODEL, config, job, SOFTWARE, gpu)
    assert planned.pipeline == pytest.approx(timeline.makespan, rel=0.01)  # costs rounded to 3 digits
    assert planned.bubble == pytest.approx(timeline.bubble_share, abs=0.01)
    assert pipeline_floor(config, costs, transfer) <= timeline.makespan * (1 + 1e-9)


def test_the_seeds_question_on_the_seeds_hardware_does_not_fit_and_says_how_much_is_missing():
    from pipeclock.plan.paper_model import mlp_model

    model, card = mlp_model(10**10, 16), KINDS["RTX4090"]
    found = search(model, Cluster(4, card), Job(128, 1), SOFTWARE)
    assert not found.ranked and found.smallest is not None
    assert found.smallest.memory.total > card.memory
    assert model.parameters() * 18 > 4 * card.memory  # bf16 copy, fp32 gradient, masters, Adam: 18 B each
    assert search(model, Cluster(16, card), Job(128, 1), SOFTWARE, top=1).ranked


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_long_step_holds_what_its_settled_rounds_hold(schedule):
    """`held_microbatches` reads a long step off two short ones when they agree: exact on every schedule."""
    from pipeclock.plan.cluster_memory import _held, held_microbatches

    for pp, chunks in ((2, 1), (3, 2), (4, 2), (4, 3), (5, 2)):
        if chunks > 1 and schedule not in ("interleaved-1f1b", "zb-v", "dualpipev"):
            continue
        if schedule in ("zb-v", "dualpipev") and chunks != 2:
            continue
        for m in range(2 * pp * chunks + 1, 6 * pp * chunks + 3):
            try:
                long = _held(schedule, pp, m, chunks)
            except ValueError:
                continue
            assert held_microbatches(schedule, pp, m, chunks) == long
            # the blocks held, with the ends in slots: the first and the last chunks a block fewer
            uneven = [[2] * chunks for _ in range(pp)]
            uneven[0][0], uneven[-1 if schedule not in ("zb-v", "dualpipev") else 0][-1] = 1, 1
            layers = tuple(map(tuple, uneven))
            assert held_microbatches(schedule, pp, m, chunks, layers) == _held(
                schedule, pp, m, chunks, layers
            )


def test_the_cached_program_simulates_as_the_simulator_does():
    from pipeclock.plan.pipeline_time import simulated

    costs = ((1.0, 2.1, 1.2, 0.9), (0.8, 1.7, 0.9, 0.8), (1.3, 2.2, 1.0, 1.2), (0.7, 1.4, 0.8, 0.6))
    ops = {"F": 0, "B": 1, "I": 2, "W": 3}
    for schedule, chunks in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)):
        pp = len(costs) // chunks
        table = generate(schedule, pp, 8, chunks)
        placement = placement_of(table)
        timeline = simulate(join_first_stage_backwards(table),
                            lambda r, a, p=placement: costs[p.stage(r, a.chunk)][ops[a.op]],
                            comm_latency=0.05)  # fmt: skip
        run = simulated(schedule, pp, 8, chunks, costs, 0.05)
        assert run.makespan == pytest.approx(timeline.makespan, rel=1e-12)
        assert run.bubble == pytest.approx(timeline.bubble_share, rel=1e-9)
