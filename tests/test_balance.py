"""Cutting a model by measured cost: the slowest stage as fast as it can be, equal layers cut as before."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations, pairwise

import pytest
import torch

from pipeclock.models.gpt import GPTConfig
from pipeclock.models.partition import cut_by_stage_cost, partition, partition_by_cost
from pipeclock.plan.model_specs import gpt_spec, mlp_spec
from pipeclock.plan.profile import ALIKE, profile


def largest_stage(costs, cut) -> float:
    return max(sum(costs[i] for i in part) for part in cut)


def every_cut(n: int, p: int):
    for bounds in combinations(range(1, n), p - 1):
        edges = (0, *bounds, n)
        yield [range(a, b) for a, b in pairwise(edges)]


@pytest.mark.parametrize("n", range(1, 10))
def test_equal_costs_give_exactly_the_cut_by_layer_count(n):
    for p in range(1, n + 1):
        assert partition_by_cost([0.1] * n, p) == partition(n, p)
        assert partition_by_cost([3.0] * n, p) == partition(n, p)


@pytest.mark.parametrize(
    "costs",
    [
        [0.01, 1, 1, 1, 1, 2.3],
        [5, 1, 1, 1, 1, 1, 1],
        [1, 2, 3, 4, 5, 6, 7, 8],
        [0.3, 0.1, 0.9, 0.2, 0.2, 0.7],
    ],
)
def test_the_cut_minimises_the_largest_stage_over_every_possible_cut(costs):
    for p in range(1, len(costs) + 1):
        cut = partition_by_cost(costs, p)
        assert [i for part in cut for i in part] == list(range(len(costs)))  # contiguous, every layer once
        assert all(len(part) >= 1 for part in cut)
        best = min(largest_stage(costs, c) for c in every_cut(len(costs), p))
        assert largest_stage(costs, cut) == pytest.approx(best)


def test_a_heavy_head_gets_a_stage_of_its_own_and_the_light_embedding_shares():
    # embed, four blocks, a head costing 2.3 blocks: by count the last stage would carry 4.3 blocks
    costs = [0.01, 1, 1, 1, 1, 2.3]
    assert partition(6, 2) == [range(0, 3), range(3, 6)]
    assert partition_by_cost(costs, 2) == [range(0, 4), range(4, 6)]
    on_four = partition_by_cost(costs, 4)
    assert on_four[-1] == range(5, 6) and largest_stage(costs, on_four) == pytest.approx(2.3)


def test_a_stage_dependent_cost_lets_the_stage_holding_more_take_less():
    # stage 0 holds three micro-batches of activations, stage 1 one: equal layers weigh 3x on stage 0
    cut = cut_by_stage_cost(8, 2, lambda stage, layers: len(layers) * (3 if stage == 0 else 1))
    assert cut == [range(0, 2), range(2, 8)]


def test_impossible_cuts_are_refused_like_partition():
    with pytest.raises(ValueError, match="at least one"):
        partition_by_cost([1.0, 1.0], 3)


def test_the_profile_measures_each_kind_once_so_identical_layers_cost_the_same():
    torch.set_num_threads(1)
    spec = mlp_spec(64, 7)
    built = []
    layers = profile(replace(spec, build=lambda i: built.append(i) or spec.build(i)), 8, repeats=2, warmup=1)
    assert [layer.name for layer in layers] == [str(i) for i in range(7)]
    # the first layer on its own (its input wants no gradient); the hidden ones timed in turn as a stage
    # runs them, ALIKE of them at most; the last
    assert built == [0, *range(1, 1 + ALIKE), 6]
    assert len({(x.forward, x.backward) for x in layers[1:-1]}) == 1  # the hidden layers: one measurement
    assert all(x.forward > 0 and x.backward > 0 and x.parameters == 64 * 64 + 64 for x in layers)
    hidden = layers[1]
    # a Linear saves its input, the ReLU its output: one (8, 64) fp32 tensor each
    assert (hidden.keeps_input, hidden.keeps_output, hidden.held) == (8 * 64 * 4, 8 * 64 * 4, 0)
    assert layers[-1].keeps_output == 0  # no ReLU after the last layer


def test_the_profile_of_a_gpt_names_its_pieces_and_a_checkpointed_block_keeps_only_its_input():
    torch.set_num_threads(1)
    layers = profile(gpt_spec(GPTConfig(dim=32, layers=3, heads=2, seq_len=16)), 2, repeats=1, warmup=0)
    assert [x.name for x in layers] == ["embed", "h0", "h1", "h2", "head"]
    assert layers[1].held > layers[1].output_bytes  # a block saves far more than it hands on
    assert layers[1].checkpointed == (0, layers[1].input_bytes, 0)
    # what W keeps after I: the Linears' inputs, which the forward saved too, and their outputs'
    # gradients, which are new; only those count when the forward's graph stays until W
    block = layers[1]
    assert block.keeps_graph and 0 < block.weight_extra < block.weight_held


def _my_layers(rank, world, balance):
    from pipeclock.training.loop import TrainConfig
    from pipeclock.training.stages import build_stage

    config = TrainConfig(hidden=32, layers=5, batch_size=8, steps=1, microbatches=2, balance=balance)
    return [sorted(int(i) for i in module.layers) for module in build_stage(config, rank, world)]


@pytest.mark.slow
def test_every_rank_builds_its_share_of_one_cut_by_time_and_the_shares_cover_the_model():
    from tests.distributed import run_ok

    for balance in ("time", "memory"):
        shares = [layers for rank in run_ok(_my_layers, 2, balance) for layers in rank]
        assert sorted(i for share in shares for i in share) == list(range(5)), balance
        assert all(share == list(range(share[0], share[-1] + 1)) for share in shares)


def test_an_unknown_balance_is_one_clear_error():
    from pipeclock.training.loop import TrainConfig

    with pytest.raises(ValueError, match="--balance must be one of layers, time, memory"):
        TrainConfig(balance="speed")
