"""bf16: autocast compute, float32 weights and gradients, half the bytes between stages, fp32's loss curve.

For every schedule (split backward included) on 2 stages, a bf16 step on the MLP and on a GPT leaves
float32 parameters with float32 gradients close to float32's (within a tenth of the largest gradient:
bf16 keeps 8 bits of mantissa), a loss close to float32's, and sends exactly half the floating-point
bytes. A GPT's residual stream, float32 under autocast, arrives on the next stage as float32 (it
travels in bf16). A split backward (I then W) computes the same bf16 gradients as a whole one. Twenty training
steps in bf16 end within 3 % of float32's loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeclock import comms, schedule
from pipeclock.engine import step_ends
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.precision import parse_precision
from pipeclock.models.gpt import GPT, GPTConfig
from pipeclock.models.mlp import ShardedMLP
from pipeclock.training.loop import TrainConfig, train
from tests.distributed import run_ok
from tests.test_gpt_pipeline import PLACEMENT, SCHEDULE_CHUNKS

GPT_CONFIG = GPTConfig(dim=32, layers=6, heads=2, seq_len=16, dropout=0.1, seed=2)


def test_a_dtype_is_fp32_or_bf16_and_anything_else_one_line():
    assert parse_precision(None).compute_dtype is None
    assert parse_precision("bf16").compute_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"^--dtype must be fp32 or bf16, got 'fp16'$"):
        TrainConfig(dtype="fp16")
    with pytest.raises(ValueError, match=r"^--recompute must be none, full, or every-K"):
        TrainConfig(recompute="every-0")


class SentBytes:
    """Counts the activation and gradient bytes this rank hands to ``comms.isend`` (not the headers, which
    are bytes, nor the loss, a float64 scalar sent to every rank once a step)."""

    def __init__(self):
        self.total = 0
        self._isend = comms.isend
        comms.isend = self._count

    def _count(self, tensor, dest, tag=0, *args, **kwargs):
        if tensor.is_floating_point() and tag != step_ends.LOSS_TAG:
            self.total += tensor.numel() * tensor.element_size()
        return self._isend(tensor, dest, tag, *args, **kwargs)


def one_step(rank: int, p: int, name: str, model: str, dtype: str, sent: SentBytes):
    chunks, placement = SCHEDULE_CHUNKS[name], PLACEMENT.get(name)
    generator = torch.Generator().manual_seed(1)
    if model == "mlp":
        modules = ShardedMLP.for_rank(64, 8, rank, p, chunks, seed=1, placement=placement)
        inputs, targets = torch.randn(12, 64, generator=generator), torch.randn(12, 64, generator=generator)
        loss_fn = F.mse_loss
    else:
        modules = GPT.for_rank(GPT_CONFIG, rank, p, chunks, placement)
        inputs = torch.randint(0, 256, (12, 16), generator=generator)
        targets = torch.randint(0, 256, (12, 16), generator=generator)
        loss_fn = TokenCrossEntropy()
    pipe = schedule.Pipeline(modules, name, 3, loss_fn, dtype=dtype)
    arrived = []
    for module in modules:
        module.register_forward_pre_hook(lambda _, args: arrived.append(args[0]))
    before = sent.total
    loss = pipe.step(inputs, targets)
    evaluated = pipe.evaluate(inputs, targets)
    parameters = [p for module in modules for p in module.parameters()]
    hidden = [leaf.dtype for tree in arrived if isinstance(tree, tuple) for leaf in tree[:1]]
    assert all(dtype == torch.float32 for dtype in hidden), f"a residual stream arrived as {hidden}"
    return loss, evaluated, [p.grad for p in parameters], parameters, sent.total - before


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def bf16_cases_on(rank: int, p: int) -> dict[tuple, dict]:
    torch.set_num_threads(1)
    sent, results, bf16_grads = SentBytes(), {}, {}
    for name in SCHEDULE_CHUNKS:
        for model in ("mlp", "gpt"):
            loss, evaluated, grads, _, fp32_bytes = one_step(rank, p, name, model, "fp32", sent)
            got, got_evaluated, got_grads, params, bf16_bytes = one_step(rank, p, name, model, "bf16", sent)
            bf16_grads[(name, model)] = got_grads
            results[(name, model)] = {
                "loss gap": abs(got - loss) / loss,
                "evaluation gap": abs(got_evaluated - evaluated) / evaluated,
                "gradient gap": max(relative_gap(a, b) for a, b in zip(got_grads, grads, strict=True)),
                "all float32": all(t.dtype == torch.float32 for t in params + got_grads),
                "bytes": (fp32_bytes, bf16_bytes),
            }
    for model in ("mlp", "gpt"):  # the same cut, B whole or split into I and W: the same bf16 math
        pairs = zip(bf16_grads[("zb-h1", model)], bf16_grads[("1f1b", model)], strict=True)
        results[("zb-h1", model)]["split gap"] = max(relative_gap(a, b) for a, b in pairs)
    return results


def test_bf16_computes_near_fp32_keeps_fp32_weights_and_gradients_and_halves_the_messages():
    per_rank = run_ok(bf16_cases_on, 2, deadline=240)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(SCHEDULE_CHUNKS) * 2
        for case, found in results.items():
            assert found["all float32"], (rank, case)
            assert found["loss gap"] < 1e-2 and found["evaluation gap"] < 1e-2, (rank, case, found)
            assert found["gradient gap"] < 0.1, (rank, case, found)  # measured: up to 0.047
            assert found.get("split gap", 0.0) <= 1e-6, (rank, case, found)
            fp32_bytes, bf16_bytes = found["bytes"]
            assert fp32_bytes > 0 and bf16_bytes * 2 == fp32_bytes, (rank, case, found)


def losses_by_dtype(rank: int, world: int) -> dict[str, list[float]]:
    """The main job at a quarter of its width (the MLP 16 x 256, batch 128, Adam at 3e-4), 20 steps."""
    torch.set_num_threads(1)
    return {
        dtype: train(TrainConfig(dtype=dtype, steps=20, hidden=256, measure_memory=False)).losses
        for dtype in ("fp32", "bf16")
    }


def test_twenty_bf16_steps_of_the_main_job_end_within_3_percent_of_fp32():
    losses = run_ok(losses_by_dtype, 2)[0]
    fp32, bf16 = losses["fp32"], losses["bf16"]
    assert fp32[-1] < 0.9 * fp32[0], "the run learned something"
    assert abs(bf16[-1] - fp32[-1]) <= 0.03 * fp32[-1], (fp32, bf16)
    assert bf16 != fp32, "bf16 really computed in bf16"
