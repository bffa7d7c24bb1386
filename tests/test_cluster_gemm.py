"""Two properties of a layer's products on paper: Megatron-LM's backward tp collective hides under the
weight gradients and no more, and a product's share of the peak grows with its smallest side
(`pipeclock.plan.gemm_efficiency`)."""

from __future__ import annotations

import pytest

from pipeclock.plan import calibration, cluster_time, gemm_efficiency
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_time import Rates, layer_time
from pipeclock.plan.gpus import KINDS
from pipeclock.plan.paper_model import PaperModel

GPT = PaperModel("test GPT", layers=4, hidden=2048, heads=16, kv_heads=16, head_dim=128, ffn=8192,
                 vocab=51200)  # fmt: skip
A100 = KINDS["A100-80GB"]


def test_the_backward_collective_hides_under_the_column_products_weight_gradients_and_no_more():
    plain = Software("bf16", fused=True)
    overlapped = Software("bf16", fused=True, tp_backward_overlap=True)
    rates = Rates(A100, plain)
    capped = False
    for tp, sp, mbs, seq in ((2, False, 4, 2048), (8, True, 1, 2048), (8, False, 1, 64), (8, True, 1, 16)):
        config, job = Config(tp, 1, 1, "1f1b", 1, mbs, 1, "none", 0, sp), Job(mbs, seq)
        before = layer_time(GPT, config, job, plain, rates)
        after = layer_time(GPT, config, job, overlapped, rates)
        tokens = mbs * seq
        column = sum(cluster_time._gemm_seconds(g, tokens, GPT, tp, 2, rates) for g in GPT.gemms()
                     if g.split == "n")  # fmt: skip
        hidden = before.input_grad - after.input_grad
        assert hidden == pytest.approx(min(before.tp, column))
        assert 0 < hidden <= after.weight_grad
        assert (after.forward, after.weight_grad) == (before.forward, before.weight_grad)
        capped |= column < before.tp
    assert capped, "a case where the collective outlasts the weight gradients, so that the cap is seen"


def test_without_tensor_parallel_the_backward_overlap_changes_nothing():
    job, rates = Job(4, 2048), Rates(A100, Software("bf16"))
    config = Config(1, 1, 1, "1f1b", 1, 4, 1, "none", 0, False)
    overlapped = layer_time(GPT, config, job, Software("bf16", tp_backward_overlap=True), rates)
    assert overlapped == layer_time(GPT, config, job, Software("bf16"), rates)


def test_a_products_share_rises_with_its_weights_shorter_side_and_is_the_constant_at_the_reference(
    monkeypatch,
):
    monkeypatch.setattr(calibration, "A100_GEMM_HALF_SIZE", 300.0)
    half, reference = gemm_efficiency.half_size("A100-80GB"), calibration.GEMM_REFERENCE_SIDE
    assert half == 300.0
    assert gemm_efficiency.size_factor(reference, 8 * reference, half) == pytest.approx(1.0)
    sides = (256, 768, 2048, 6144, 25600)
    factors = [gemm_efficiency.size_factor(side, 65536, half) for side in sides]
    assert factors == sorted(factors) and len(set(factors)) == len(factors)
    assert factors[-1] < (reference + half) / reference
    assert gemm_efficiency.size_factor(768, 8192, half) == gemm_efficiency.size_factor(8192, 768, half)


def test_with_no_half_size_every_product_reaches_its_kinds_constant(monkeypatch):
    monkeypatch.setattr(calibration, "H100_GEMM_HALF_SIZE", 0.0)
    half = gemm_efficiency.half_size("H100-80GB")
    assert {gemm_efficiency.size_factor(k, 9, half) for k in (16, 2048, 10**6)} == {1.0}


def test_a_deepspeed_run_computes_its_products_at_the_named_share_and_nothing_else_changes():
    config, job = Config(2, 1, 1, "1f1b", 1, 1, 1, "none", 0, False), Job(1, 2048)
    plain, deepspeed = Software("bf16", fused=True), Software("bf16", fused=True, deepspeed=True)
    before = layer_time(GPT, config, job, plain, Rates(A100, plain))
    after = layer_time(GPT, config, job, deepspeed, Rates(A100, deepspeed))
    assert Rates(A100, deepspeed).gemm == pytest.approx(Rates(A100, plain).gemm * calibration.DEEPSPEED_SHARE)
    assert after.weight_grad > before.weight_grad  # the products alone slow down
    assert after.tp == before.tp
