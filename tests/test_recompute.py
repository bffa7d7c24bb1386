"""Activation recompute: the same math with less memory, and each block rebuilt once per micro-batch.

For every schedule (split backward included), p in {1, 2, 3} and m in {1, 3}, on the MLP and on a GPT
with dropout, a step with ``recompute`` leaves the loss and every gradient within 1e-6 relative of the
same step without it. Meanwhile every ``nn.Linear`` counts its forwards: one per micro-batch, and
exactly one more for those inside a checkpoint (the rebuild), whichever the schedule; and the measured
activation peak falls.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeclock import schedule
from pipeclock.engine import rng
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.recompute import (
    apply_recompute,
    blocks_of,
    checkpointed_spans,
    parse_policy,
)
from pipeclock.models.gpt import GPT, Block, GPTConfig
from pipeclock.models.mlp import ShardedMLP
from tests.distributed import run_ok
from tests.test_gpt_pipeline import PLACEMENT, SCHEDULE_CHUNKS

TOLERANCE = 1e-6
POLICIES = ("full", "every-2")  # the whole chunk; and some blocks checkpointed, others not
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev")
GPT_CONFIG = GPTConfig(dim=16, layers=6, heads=2, seq_len=8, dropout=0.2, seed=5)


def test_a_policy_is_none_full_or_every_k():
    assert not parse_policy("none").enabled and not parse_policy(None).enabled
    assert parse_policy("full").enabled
    assert parse_policy("every-3").every == 3
    for bad in ("every-0", "every-", "some", "every-2x", "Full"):
        with pytest.raises(ValueError, match="none, full, or every-K"):
            parse_policy(bad)


def test_every_k_checkpoints_every_kth_block_and_full_the_whole_chunk():
    chunk = ShardedMLP(8, 6)
    layers = list(chunk.layers.values())
    assert blocks_of(chunk) == layers
    assert checkpointed_spans(chunk, parse_policy("every-2")) == layers[1::2]
    assert checkpointed_spans(chunk, parse_policy("full")) == [chunk]
    assert checkpointed_spans(chunk, parse_policy("none")) == []


def test_checkpointed_modules_keep_their_names_and_their_outputs():
    chunk = GPT.for_rank(GPT_CONFIG, 0, 1)[0]
    names = list(chunk.state_dict())
    ids = torch.randint(0, 256, (3, 8))
    with torch.no_grad():
        before = chunk(ids)
    apply_recompute([chunk], "every-1")
    apply_recompute([chunk], "every-1")  # twice is harmless
    assert list(chunk.state_dict()) == names
    with torch.no_grad():
        assert torch.equal(chunk(ids), before)


def block_gradients(policy: str | None, key: tuple[int, int]) -> list[torch.Tensor]:
    """A GPT block with heavy dropout: forward under ``key``, backward after the key's block has closed."""
    block = Block(GPTConfig(dim=16, heads=2, seq_len=8, dropout=0.5, seed=3), index=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    if policy:
        apply_recompute([nn.Sequential(block)], policy)
    x = torch.randn(4, 8, 16, generator=generator, requires_grad=True)
    positions = torch.arange(8).expand(4, -1)
    with rng.keyed(*key):
        out, _ = block((x, positions))
    out.square().sum().backward()  # the rebuild runs here, outside ``keyed``
    return [x.grad] + [p.grad for p in block.parameters()]


def test_a_rebuilt_block_meets_the_dropout_masks_of_its_own_forward():
    plain = block_gradients(None, key=(7, 11))
    rebuilt = block_gradients("every-1", key=(7, 11))
    assert all(torch.equal(a, b) for a, b in zip(plain, rebuilt, strict=True))
    other_key = block_gradients(None, key=(0, 0))
    assert not torch.allclose(plain[0], other_key[0]), "the masks really depend on the key"


# --- every schedule on real processes ------------------------------------------------------------------


def build(model: str, rank: int, p: int, name: str) -> list[nn.Module]:
    chunks, placement = SCHEDULE_CHUNKS[name], PLACEMENT.get(name)
    if model == "mlp":
        return ShardedMLP.for_rank(16, 12, rank, p, chunks, seed=3, placement=placement)
    return GPT.for_rank(GPT_CONFIG, rank, p, chunks, placement)


def batch(model: str, m: int):
    generator = torch.Generator().manual_seed(m)
    size = 2 * m + 1
    if model == "mlp":
        return torch.randn(size, 16, generator=generator), torch.randn(size, 16, generator=generator)
    ids = torch.randint(0, 256, (size, 8), generator=generator)
    return ids, torch.randint(0, 256, (size, 8), generator=generator)


def count_linear_forwards(chunks: list[nn.Module]) -> dict[nn.Linear, int]:
    counts: dict[nn.Linear, int] = {}

    def count(module, args):
        counts[module] = counts.get(module, 0) + 1

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, nn.Linear):
                counts[module] = 0
                module.register_forward_pre_hook(count)
    return counts


def one_step(rank: int, p: int, name: str, model: str, m: int, policy: str | None):
    chunks = build(model, rank, p, name)
    loss_fn = F.mse_loss if model == "mlp" else TokenCrossEntropy()
    pipe = schedule.Pipeline(chunks, name, m, loss_fn, recompute=policy)
    counts = count_linear_forwards(chunks)
    pipe.steps_done = 4  # a step other than 0: the rebuild must re-enter the step's dropout key too
    loss = pipe.step(*batch(model, m))
    inside = {module for chunk in chunks for span in checkpointed_spans(chunk, parse_policy(policy))
              for module in span.modules()}  # fmt: skip
    wrong_counts = [
        (type(module).__name__, seen)
        for module, seen in counts.items()
        if seen != (2 * m if module in inside else m)
    ]
    grads = [p.grad for chunk in chunks for p in chunk.parameters()]
    return loss, grads, pipe.last.peak_activation_bytes, wrong_counts


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def recompute_cases_on(rank: int, p: int) -> dict[tuple, tuple]:
    """Per (schedule, model, m, policy): the worst gap to no recompute, both peaks, the wrong counts."""
    torch.set_num_threads(1)  # tiny tensors: threads only add waiting on a busy machine
    results = {}
    for name in SCHEDULE_CHUNKS:
        for model in ("mlp", "gpt"):
            for m in (1, 3):
                loss, grads, peak, _ = one_step(rank, p, name, model, m, None)
                for policy in POLICIES:
                    got_loss, got_grads, got_peak, wrong = one_step(rank, p, name, model, m, policy)
                    gaps = [abs(got_loss - loss) / abs(loss)]
                    gaps += [relative_gap(a, b) for a, b in zip(got_grads, grads, strict=True)]
                    results[(name, model, m, policy)] = (max(gaps), peak, got_peak, wrong)
    return results


@pytest.mark.parametrize("p", [1, 2, 3])
def test_recompute_changes_no_math_rebuilds_each_block_once_and_holds_less(p):
    per_rank = run_ok(recompute_cases_on, p, deadline=300)
    cases = per_rank[0].keys()
    assert len(cases) == len(SCHEDULE_CHUNKS) * 2 * 2 * len(POLICIES)
    gaps = {case: max(results[case][0] for results in per_rank) for case in cases}
    bad = {case: gap for case, gap in gaps.items() if gap > TOLERANCE}
    assert not bad, f"recompute changed the loss or gradients in {len(bad)} cases: {bad}"
    counts = {(r, case): res[case][3] for r, res in enumerate(per_rank) for case in cases if res[case][3]}
    assert not counts, f"Linear forwards other than one per micro-batch plus one rebuild: {counts}"
    for case in cases:
        name, model, _, policy = case
        none_peak, peak = per_rank[0][case][1], per_rank[0][case][2]
        assert peak <= none_peak, f"{case}: recompute held more ({peak} > {none_peak})"
        # An MLP layer keeps only its input anyway, so only ``full`` saves there; and between a split
        # backward's I and W, the MLP's Linears need their inputs back, recompute or not.
        falls = model == "gpt" or (policy == "full" and name not in SPLIT_BACKWARD)
        if falls:
            assert peak < none_peak, f"{case}: the activation peak did not fall ({peak} >= {none_peak})"
