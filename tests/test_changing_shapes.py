"""Shapes that change between steps give the one-process result, in ``step`` and ``evaluate``.

A user's sequence length may change from batch to batch, and a data set's last batch is often smaller.
Each step's messages must carry that step's shapes: for every schedule and placement, on 2 and 3 stages,
the MLP on [batch, length, width] inputs and the GPT with a tied embedding, with the length changing at
every step (longer, shorter, the same again) and a smaller last batch, every step's loss and gradients
and every evaluation's loss equal the whole model's on one process. Real gloo processes, one launch per
stage count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeclock import schedule
from pipeclock.engine import rng
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.ties import tie_key
from pipeclock.model import ShardedMLP
from pipeclock.models.gpt import GPT, GPTConfig, gpt_sequential
from tests.cases import SCHEDULE_CHUNKS, V_PLACED
from tests.distributed import run_ok

TOLERANCE = 1e-5
# (batch, sequence length) of each step: longer, the same again, shorter, then a smaller last batch
STEPS = ((8, 6), (8, 9), (8, 9), (8, 3), (5, 3))


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def mlp_steps(rank: int, p: int, name: str) -> float:
    """Worst gap over steps whose [batch, length, 8] inputs change shape, each step checked alone."""
    placement = "v" if name in V_PLACED else "loop"
    chunks = ShardedMLP.for_rank(8, 8, rank, p, SCHEDULE_CHUNKS[name], seed=3, placement=placement)
    reference = ShardedMLP(8, 8, seed=3)
    pipe = schedule.Pipeline(chunks, name, 3, F.mse_loss)
    wanted = dict(reference.named_parameters())
    gaps = []
    for index, (batch, length) in enumerate(STEPS):
        generator = torch.Generator().manual_seed(index)
        inputs = torch.randn(batch, length, 8, generator=generator)
        targets = torch.randn(batch, length, 8, generator=generator)
        for module in [*chunks, reference]:
            module.zero_grad()
        want = F.mse_loss(reference(inputs), targets)
        want.backward()
        gaps.append(abs(pipe.step(inputs, targets) - want.item()) / want.item())
        gaps += [relative_gap(q.grad, wanted[n].grad) for c in chunks for n, q in c.named_parameters()]
        with torch.no_grad():
            want = F.mse_loss(reference(inputs), targets).item()
        gaps.append(abs(pipe.evaluate(inputs, targets) - want) / want)
    return max(gaps)


def gpt_steps(rank: int, p: int, name: str) -> float:
    """The same for the GPT (tied embedding, token loss): the length of the token ids changes."""
    cfg = GPTConfig(dim=16, layers=4, heads=2, seq_len=12, seed=5)
    chunks = GPT.for_rank(cfg, rank, p, SCHEDULE_CHUNKS[name], "v" if name in V_PLACED else None)
    reference, loss_fn = gpt_sequential(cfg), TokenCrossEntropy()
    pipe = schedule.Pipeline(chunks, name, 3, loss_fn)
    wanted = dict(reference.named_parameters())
    gaps = []
    for index, (batch, length) in enumerate(STEPS):
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(0, 256, (batch, length), generator=generator)
        targets = torch.randint(0, 256, (batch, length), generator=generator)
        for module in [*chunks, reference]:
            module.zero_grad()
        with rng.keyed(step=index, first_sample=0):
            want = loss_fn.mean(reference(ids), targets)
        want.backward()
        gaps.append(abs(pipe.step(ids, targets) - want.item()) / want.item())
        for chunk in chunks:
            for param_name, param in chunk.named_parameters():
                gaps.append(relative_gap(param.grad, wanted[tie_key(param) or param_name].grad))
        with torch.no_grad():
            reference.eval()
            want = loss_fn.mean(reference(ids), targets).item()
            reference.train()
        gaps.append(abs(pipe.evaluate(ids, targets) - want) / want)
    return max(gaps)


MODELS = {"mlp": mlp_steps, "gpt": gpt_steps}


def every_schedule(rank: int, p: int, models: tuple[str, ...]) -> dict[tuple[str, str], float]:
    return {(model, name): MODELS[model](rank, p, name) for model in models for name in SCHEDULE_CHUNKS}


@pytest.mark.parametrize(("p", "models"), [(2, ("mlp", "gpt")), (3, ("mlp",))])
def test_a_length_that_changes_every_step_and_a_smaller_last_batch_give_the_one_process_result(p, models):
    per_rank = run_ok(every_schedule, p, models, deadline=420)
    worst = {case: max(results[case] for results in per_rank) for case in per_rank[0]}
    bad = {case: gap for case, gap in worst.items() if gap > TOLERANCE}
    assert not bad, f"changing shapes differ from the one-process model: {bad}"


def three_steps(rank: int, p: int) -> dict[str, list[float]]:
    """On 1F1B over two stages, the three ways a changing length used to go wrong, each from a fresh
    pipeline: the pipeline's losses beside the one-process model's."""
    found = {}
    for case, lengths, evaluates in (
        ("evaluate", (16, 24, 8), True),
        ("longer", (16, 24), False),
        ("shorter", (24, 16), False),
    ):
        chunks = ShardedMLP.for_rank(16, 4, rank, p, seed=1)
        reference = ShardedMLP(16, 4, seed=1)
        pipe = schedule.Pipeline(chunks, "1f1b", 2, F.mse_loss)
        got, want = [], []
        for length in lengths:
            generator = torch.Generator().manual_seed(length)
            inputs = torch.randn(2, length, 16, generator=generator)
            targets = torch.randn(2, length, 16, generator=generator)
            run = pipe.evaluate if evaluates else pipe.step
            got.append(run(inputs, targets))
            with torch.no_grad():
                want.append(F.mse_loss(reference(inputs), targets).item())
        found[case] = [abs(a - b) / b for a, b in zip(got, want, strict=True)]
    return found


@pytest.fixture(scope="module")
def three_cases() -> dict[str, list[float]]:
    return run_ok(three_steps, 2)[0]


def test_evaluate_on_lengths_16_24_8_gives_the_one_process_losses(three_cases):
    assert max(three_cases["evaluate"]) <= TOLERANCE, three_cases["evaluate"]


def test_a_longer_sequence_after_a_shorter_one_is_received_whole(three_cases):
    assert max(three_cases["longer"]) <= TOLERANCE, three_cases["longer"]


def test_a_shorter_sequence_after_a_longer_one_is_received_with_its_own_shape(three_cases):
    assert max(three_cases["shorter"]) <= TOLERANCE, three_cases["shorter"]
