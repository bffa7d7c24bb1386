"""A data-parallel collective's link per rank (`pipeclock.plan.group_link`): the NICs its group's ranks own
on each node, as NCCL lays its channels over them, up to the node's own link; with tp 8 a node holds one
rank of a group, and the exchange is what it was on one NIC. The ranks here are laid out pp outermost
(Megatron-LM's order); pipeclock's own: tests/test_cluster_rank_order.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeclock.plan import calibration
from pipeclock.plan.cluster_config import PP_OUTERMOST, Config, Job, Software
from pipeclock.plan.cluster_time import Rates, data_parallel_seconds, step_time
from pipeclock.plan.gpus import KINDS
from pipeclock.plan.group_link import (
    bandwidth,
    group_in_one_node,
    message_crosses_nodes,
    one_nic_a_rank,
    ranks_per_node,
)
from pipeclock.plan.paper_model import PaperModel

H100, A100, RTX4090 = KINDS["H100-80GB"], KINDS["A100-80GB"], KINDS["RTX4090"]
ONE_PER_NODE = replace(H100, gpus_per_node=1)  # every rank its own node: one NIC for each, always
ONE_PER_NODE_A100 = replace(A100, gpus_per_node=1)
FRAMEWORKS = Software("bf16", rank_order=PP_OUTERMOST)
MODEL = PaperModel("test 1.2B", layers=16, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632,
                   vocab=32000)  # fmt: skip


def config(tp: int, pp: int, dp: int, zero: int = 1, microbatches: int = 4) -> Config:
    return Config(tp=tp, pp=pp, dp=dp, schedule="1f1b", chunks=1, microbatch_size=1,
                  microbatches=microbatches, recompute="none", zero=zero,
                  sequence_parallel=tp > 1)  # fmt: skip


def test_a_node_holds_eight_over_tp_ranks_of_a_data_parallel_group_whatever_pp():
    layouts = [(8, 1, 32), (2, 1, 32), (1, 1, 64), (2, 2, 16), (1, 16, 4), (4, 4, 4), (8, 16, 8)]
    assert [ranks_per_node(config(*layout), H100, PP_OUTERMOST) for layout in layouts] == [
        1,
        4,
        8,
        4,
        4,
        2,
        1,
    ]
    assert (
        ranks_per_node(config(1, 1, 12), H100, PP_OUTERMOST) == 4
    )  # nodes of 8 and 4: the emptier sets the pace


def test_a_tp_8_layout_gets_one_nic_a_rank_as_before():
    assert bandwidth(config(8, 1, 32), H100, FRAMEWORKS) == H100.inter_node_bandwidth
    assert bandwidth(config(8, 4, 8), A100, FRAMEWORKS) == A100.inter_node_bandwidth
    assert (
        bandwidth(config(4, 2, 8), A100, FRAMEWORKS) == 2 * A100.inter_node_bandwidth
    )  # pp no longer splits a node


def test_a_stage_that_fills_part_of_a_node_keeps_its_group_on_nvlink():
    assert group_in_one_node(
        config(1, 4, 4), H100, PP_OUTERMOST
    )  # 16 GPUs: stages 0-1 on one node, 2-3 on the other
    assert bandwidth(config(1, 4, 4), H100, FRAMEWORKS) == H100.intra_node_bandwidth
    assert not group_in_one_node(config(4, 4, 4), H100, PP_OUTERMOST)  # a stage spans two nodes


def test_pipeline_messages_cross_the_network_once_the_run_spans_nodes():
    assert message_crosses_nodes(config(1, 4, 4), H100, PP_OUTERMOST)  # stages 1 and 2 sit on different nodes
    assert not message_crosses_nodes(config(1, 4, 2), H100, PP_OUTERMOST)  # the whole pipeline in one node
    assert not message_crosses_nodes(config(1, 1, 64), H100, PP_OUTERMOST)  # no pipeline


def test_k_ranks_a_node_get_k_nics_until_the_node_link_is_the_slower():
    assert bandwidth(config(2, 1, 32), H100) == 4 * H100.inter_node_bandwidth
    assert bandwidth(config(1, 1, 64), H100) == 8 * H100.inter_node_bandwidth  # 400 GB/s under NVLink's 450
    assert bandwidth(config(1, 1, 384), A100) == 8 * A100.inter_node_bandwidth  # 200 GB/s under 300
    assert bandwidth(config(1, 1, 64), RTX4090) == RTX4090.intra_node_bandwidth  # PCIe: 32 < 8 x 12.5
    assert bandwidth(config(1, 1, 8), H100) == H100.intra_node_bandwidth  # one node: NVLink alone


def test_an_exchange_nothing_hides_takes_one_kth_of_the_time_on_k_nics():
    software = Software("bf16")
    layout = config(2, 1, 32, zero=2)  # ZeRO-2: each micro-batch's gradients, here with no compute to hide
    latency = layout.microbatches * calibration.COLLECTIVE_LATENCY

    def exposed(gpu) -> float:
        return data_parallel_seconds(MODEL, layout, software, Rates(gpu, software), [{"B": 0.0}], None, 1.0)

    assert exposed(ONE_PER_NODE) - latency == pytest.approx(4 * (exposed(H100) - latency))


def test_a_tp_8_layouts_step_is_what_it_was_with_one_nic_a_rank():
    job, software = Job(32 * 4, 2048), Software("bf16", fused=True)
    eight, two = config(8, 1, 32), config(2, 1, 32)

    def step(layout, gpu):
        return step_time(MODEL, layout, job, software, gpu)

    assert step(eight, H100) == step(eight, ONE_PER_NODE)
    assert step(two, H100).dp < step(two, ONE_PER_NODE).dp


def test_deepspeeds_zero_3_keeps_one_nic_a_rank_and_its_zero_1_gets_the_nodes_nics():
    deepspeed, plain = Software("bf16", deepspeed=True), Software("bf16")
    zero3, zero1 = config(1, 1, 384, zero=3), config(8, 35, 8, zero=1)
    assert one_nic_a_rank(zero3, deepspeed) and not one_nic_a_rank(zero3, plain)
    assert not one_nic_a_rank(zero1, deepspeed)  # MT-NLG, BLOOM: ZeRO-1 under DeepSpeed
    assert bandwidth(zero3, A100, deepspeed) == A100.inter_node_bandwidth
    assert bandwidth(zero3, A100, plain) == 8 * A100.inter_node_bandwidth
    assert bandwidth(config(2, 1, 32, zero=1), H100, deepspeed) == 4 * H100.inter_node_bandwidth
    assert bandwidth(config(1, 1, 8, zero=3), A100, deepspeed) == A100.intra_node_bandwidth  # one node


def test_deepspeeds_zero_3_step_is_the_one_nic_step():
    job, deepspeed = Job(64, 2048), Software("bf16", fused=True, deepspeed=True)
    layout = config(1, 1, 64, zero=3, microbatches=1)
    assert step_time(MODEL, layout, job, deepspeed, A100) == step_time(
        MODEL, layout, job, deepspeed, ONE_PER_NODE_A100
    )
