"""The loss on paper against the loss measured: Megatron-LM's cross-entropy on an H100 SXM
(`calibration.LOSS_BYTES`, docs/cluster.md), and the published row whose step it weighs most in."""

from __future__ import annotations

import dataclasses

import pytest

from pipeclock.plan.cluster_config import Software
from pipeclock.plan.cluster_time import Rates, loss_seconds
from pipeclock.plan.gpus import KINDS


def test_the_loss_costs_what_megatron_lms_loss_was_measured_to_cost_on_an_h100():
    """Liger-Kernel's benchmark data: 2,048 x 4 tokens of 131,072 bf16 logits, 15.81 ms forward and
    21.25 ms with the backward (provider megatron-unfused, TP 1, an H100 80GB HBM3)."""
    forward, backward = loss_seconds(2048 * 4 * 131072, Rates(KINDS["H100-80GB"], Software("bf16")))
    assert forward == pytest.approx(15.81e-3, rel=0.002)
    assert forward + backward == pytest.approx(21.25e-3, rel=0.002)


def test_the_loss_splits_over_the_tensor_parallel_ranks_vocabularies():
    rates = Rates(KINDS["H100-80GB"], Software("bf16"))
    whole, split = loss_seconds(4096 * 131072, rates), loss_seconds(4096 * 131072 / 8, rates)
    assert split == pytest.approx((whole[0] / 8, whole[1] / 8))


@pytest.mark.long  # transformers' GPT-2 config, then one search
def test_megatron_lms_smallest_h100_run_whose_head_is_a_fifth_of_its_step_reads_within_10_percent():
    pytest.importorskip("transformers")
    from benchmarks.cluster_check import errors, predict
    from benchmarks.published_2024 import megatron_rows
    from pipeclock.cli.plan_cluster import parse_fix

    (row,) = [row for row in megatron_rows() if row.name == "GPT 1.7B"]
    row = dataclasses.replace(row, fixed=row.fixed | parse_fix("microbatch-size=4,zero=2"))
    row.predicted = predict(row)
    speed, _ = errors(row)
    assert abs(speed) <= 0.10, f"{speed:+.1%}"
