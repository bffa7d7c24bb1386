"""model: balanced partitions, and stage slices that equal the one-device model exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeclock.model import ShardedMLP, full_mlp, partition, split_sequential


@pytest.mark.parametrize("num_layers", [1, 5, 16, 17])
def test_partition_is_contiguous_complete_and_balanced(num_layers):
    for num_stages in range(1, num_layers + 1):
        ranges = partition(num_layers, num_stages)
        assert [i for r in ranges for i in r] == list(range(num_layers))
        sizes = [len(r) for r in ranges]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot split 16 layers into 17 stages"):
        partition(16, 17)
    with pytest.raises(ValueError, match="cannot split 4 layers into 6 stages"):
        split_sequential(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]), 0, 3, chunks=2)


@pytest.mark.parametrize("bad_stage", [-1, 4])
def test_a_stage_out_of_range_is_a_clear_error(bad_stage):
    with pytest.raises(ValueError, match=f"stage {bad_stage} is out of range for 4 stages"):
        ShardedMLP(8, 16, stage=bad_stage, num_stages=4)
    with pytest.raises(ValueError, match=f"stage {bad_stage} is out of range for 4 stages"):
        split_sequential(full_mlp(8), bad_stage, 4)


def test_sharded_stages_equal_the_one_stage_model_parameter_for_parameter():
    whole = dict(ShardedMLP(16, 16, seed=3).named_parameters())
    for num_stages in range(1, 17):
        seen = {}
        for stage in range(num_stages):
            part = ShardedMLP(16, 16, stage, num_stages, seed=3)
            assert list(part.layer_indices) == list(partition(16, num_stages)[stage])
            seen.update(part.named_parameters())
        assert seen.keys() == whole.keys()
        assert all(torch.equal(seen[name], whole[name]) for name in whole)


def test_a_rank_builds_only_its_own_layers():
    part = ShardedMLP(32, 16, stage=1, num_stages=4)
    assert sorted(int(i) for i in part.layers) == [4, 5, 6, 7]
    assert sum(p.numel() for p in part.parameters()) == 4 * (32 * 32 + 32)


def test_chained_stages_compute_the_one_stage_model():
    x = torch.randn(5, 16)
    expected = ShardedMLP(16, 16, seed=1)(x)
    for num_stages in (2, 3, 7):
        out = x
        for stage in range(num_stages):
            out = ShardedMLP(16, 16, stage, num_stages, seed=1)(out)
        assert torch.equal(out, expected)


def test_sharded_mlp_layers_equal_full_mlp_linears():
    linears = [m for m in full_mlp(8, 16, seed=2) if isinstance(m, nn.Linear)]
    sharded = ShardedMLP(8, 16, seed=2).layers
    assert all(torch.equal(linears[i].weight, sharded[str(i)].weight) for i in range(16))
    x = torch.randn(3, 8)
    assert torch.equal(full_mlp(8, 16, seed=2)(x), ShardedMLP(8, 16, seed=2)(x))


def test_interleaved_chunks_are_dealt_round_robin():
    chunks = ShardedMLP.for_rank(8, 16, rank=1, num_stages=2, chunks=2)
    assert [list(c.layer_indices) for c in chunks] == [[4, 5, 6, 7], [12, 13, 14, 15]]


def _varied_sequential():
    return nn.Sequential(
        nn.Linear(6, 10),
        nn.GELU(),
        nn.LayerNorm(10),
        nn.Linear(10, 4),
        nn.Tanh(),
        nn.Linear(4, 3),
        nn.Sigmoid(),
    )


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_split_sequential_slices_cover_the_model_in_order_with_its_own_names(chunks):
    seq = _varied_sequential()
    for num_stages in range(1, len(seq) // chunks + 1):
        per_rank = [split_sequential(seq, r, num_stages, chunks) for r in range(num_stages)]
        if chunks == 1:
            per_rank = [[part] for part in per_rank]
        in_order = [per_rank[v % num_stages][v // num_stages] for v in range(num_stages * chunks)]
        assert [m for part in in_order for m in part] == list(seq)
        names = [name for part in in_order for name, _ in part.named_parameters()]
        assert names == [name for name, _ in seq.named_parameters()]
