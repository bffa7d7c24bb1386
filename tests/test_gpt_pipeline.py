"""The one-device promise for a real model: a GPT with a tied embedding, token losses with padding, dropout.

For every schedule (on the loop placement, and ZB-V and DualPipeV on the V, where the embedding and
the head share rank 0), stage count p and micro-batch count m, one pipelined step on a GPT whose embedding
(first stage) and LM head (last stage) share one matrix leaves the loss and every gradient, the tied
matrix's included, within 1e-5 relative of the whole model on one process for the whole batch. The
targets hold padding (``ignore_index``) spread unevenly over the samples, so micro-batches count
different numbers of tokens; half the cases run with dropout, whose masks must not depend on the cut.
"""

from __future__ import annotations

import pytest
import torch

from pipeclock import schedule
from pipeclock.engine import rng
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.ties import tie_key
from pipeclock.models.gpt import GPT, GPTConfig, gpt_sequential
from tests.cases import PLACEMENT, SCHEDULE_CHUNKS
from tests.distributed import run_ok

TOLERANCE = 1e-5


def config(dropout: float) -> GPTConfig:
    return GPTConfig(dim=16, layers=6, heads=2, seq_len=8, dropout=dropout, seed=11)


def padded_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets where sample i ends in ``i % 5`` padding positions (ignored by the loss)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, 8), generator=generator)
    targets = torch.randint(0, 256, (batch, 8), generator=generator)
    for sample in range(batch):
        padding = sample % 5
        if padding:
            targets[sample, -padding:] = -100
    return ids, targets


def global_name(name: str, parameter: torch.Tensor) -> str:
    """A stage's parameter under its one-device name (a tied copy under the weight it copies)."""
    return tie_key(parameter) or name


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def one_case(rank: int, p: int, name: str, m: int, batch: int, dropout: float) -> float:
    """Worst relative gap (loss and every gradient) between the pipelined GPT and the one-process GPT."""
    cfg, loss_fn = config(dropout), TokenCrossEntropy()
    chunks = GPT.for_rank(cfg, rank, p, SCHEDULE_CHUNKS[name], PLACEMENT.get(name))
    ids, targets = padded_batch(batch, seed=batch * 7 + m)
    loss = schedule.Pipeline(chunks, name, m, loss_fn).step(ids, targets)
    return worst_gap(cfg, ids, targets, loss, chunks)


def worst_gap(cfg: GPTConfig, ids, targets, loss: float, chunks, grad_of=lambda p: p.grad) -> float:
    """The worst relative gap between a pipelined step (its loss, its chunks' gradients) and the whole
    GPT's on one process for the whole batch; ``grad_of`` reads a parameter's whole gradient."""
    reference, loss_fn = gpt_sequential(cfg), TokenCrossEntropy()
    with rng.keyed(step=0, first_sample=0):
        want = loss_fn.mean(reference(ids), targets)
    want.backward()
    wanted = dict(reference.named_parameters())
    gaps = [abs(loss - want.item()) / abs(want.item())]
    for chunk in chunks:
        for param_name, parameter in chunk.named_parameters():
            gaps.append(relative_gap(grad_of(parameter), wanted[global_name(param_name, parameter)].grad))
    return max(gaps)


def gpt_cases_on(rank: int, p: int) -> dict[tuple, float]:
    results = {}
    for name in SCHEDULE_CHUNKS:
        for m in sorted({1, 3, p, 2 * p + 1}):
            for dropout in (0.0, 0.2):
                batch = 2 * m + 1  # uneven micro-batches
                results[(name, m, batch, dropout)] = one_case(rank, p, name, m, batch, dropout)
    return results


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_schedule_leaves_the_one_process_gpt_gradients_with_padding_dropout_and_the_tie(p):
    per_rank = run_ok(gpt_cases_on, p, deadline=420)
    cases = per_rank[0].keys()
    assert len(cases) == len(SCHEDULE_CHUNKS) * len({1, 3, p, 2 * p + 1}) * 2
    worst = {case: max(results[case] for results in per_rank) for case in cases}
    bad = {case: gap for case, gap in worst.items() if gap > TOLERANCE}
    assert not bad, f"the GPT's gradients differ from one process in {len(bad)} cases: {bad}"


def dropout_losses(rank: int, p: int) -> dict[str, float]:
    """The loss of one step with dropout, for every schedule, on p stages (m = 3)."""
    cfg, losses = config(0.3), {}
    for name in SCHEDULE_CHUNKS:
        chunks = GPT.for_rank(cfg, rank, p, SCHEDULE_CHUNKS[name], PLACEMENT.get(name))
        ids, targets = padded_batch(7, seed=1)
        losses[name] = schedule.Pipeline(chunks, name, 3, TokenCrossEntropy()).step(ids, targets)
    return losses


def test_dropout_gives_the_same_loss_on_any_number_of_stages_and_any_schedule():
    by_stages = {p: run_ok(dropout_losses, p)[0] for p in (1, 2, 3)}
    values = [loss for losses in by_stages.values() for loss in losses.values()]
    assert max(values) - min(values) <= 1e-6 * abs(values[0]), by_stages
    ids, targets = padded_batch(7, seed=1)
    with rng.keyed(step=0, first_sample=0):
        without = TokenCrossEntropy().mean(gpt_sequential(config(0.0))(ids), targets).item()
    assert abs(without - values[0]) > 1e-3, "dropout really changed the loss"
