"""Whose rank order the cluster planner plans (`Software.rank_order`, `pipeclock.plan.group_link`):
Megatron-LM's and torchtitan's, pp outermost, by default and for the published runs; pipeclock's own
mesh, dp outermost, when asked. With dp outermost a stage's replicas sit a pipeline's pp x tp ranks
apart, and a pipeline's neighbouring stages tp apart."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from pipeclock.parallel.mesh import mesh_layout
from pipeclock.plan import cluster_report
from pipeclock.plan.cluster_config import DP_OUTERMOST, PP_OUTERMOST, Config, Job, Software
from pipeclock.plan.cluster_time import Rates, message_seconds
from pipeclock.plan.gpus import KINDS, Cluster
from pipeclock.plan.group_link import (
    bandwidth,
    group_in_one_node,
    message_crosses_nodes,
    rank,
    ranks_per_node,
)
from pipeclock.plan.paper_model import PaperModel

H100 = KINDS["H100-80GB"]
PIPECLOCK, FRAMEWORKS = Software("bf16", rank_order=DP_OUTERMOST), Software("bf16")
MODEL = PaperModel("test 1.2B", layers=16, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632,
                   vocab=32000)  # fmt: skip


def config(tp: int, pp: int, dp: int, cp: int = 1) -> Config:
    return Config(tp=tp, pp=pp, dp=dp, schedule="1f1b", chunks=1, microbatch_size=1, microbatches=8,
                  recompute="none", zero=1, sequence_parallel=tp > 1, cp=cp)  # fmt: skip


def coordinates(layout: Config):
    return itertools.product(range(layout.dp), range(layout.pp), range(layout.cp), range(layout.tp))


def test_the_frameworks_order_is_the_default_and_pipeclocks_is_the_engines_mesh():
    assert Software().rank_order == PP_OUTERMOST
    layout, engine = config(tp=2, pp=3, dp=2), mesh_layout(12, dp=2, tp=2)
    for d, s, c, t in coordinates(layout):
        assert rank(layout, DP_OUTERMOST, d, s, c, t) == engine[d, s, t].item()


@pytest.mark.parametrize("order", [DP_OUTERMOST, PP_OUTERMOST])
def test_each_order_places_every_rank_once_tp_innermost_and_cp_next(order):
    layout = config(tp=2, pp=2, dp=2, cp=2)
    ranks = [rank(layout, order, *where) for where in coordinates(layout)]
    assert sorted(ranks) == list(range(layout.gpus))
    assert rank(layout, order, 1, 1, 1, 1) - rank(layout, order, 1, 1, 1, 0) == 1
    assert rank(layout, order, 1, 1, 1, 0) - rank(layout, order, 1, 1, 0, 0) == layout.tp


@pytest.mark.parametrize("order", [DP_OUTERMOST, PP_OUTERMOST])
@pytest.mark.parametrize("layout", [(2, 4, 8), (1, 8, 8), (4, 2, 8), (2, 2, 16), (1, 1, 64), (8, 4, 4)])
def test_ranks_per_node_is_what_the_layout_puts_on_the_emptiest_node(order, layout):
    layout = config(*layout)
    group = [rank(layout, order, d, 0, c, 0) for d in range(layout.dp) for c in range(layout.cp)]
    per_node = Counter(r // H100.gpus_per_node for r in group)
    assert ranks_per_node(layout, H100, order) == min(per_node.values())


def test_with_dp_outermost_a_pipeline_filling_a_node_leaves_one_rank_of_a_group_a_node():
    for tp, pp in ((1, 8), (2, 4), (4, 2)):
        layout = config(tp, pp, dp=8)
        assert ranks_per_node(layout, H100, DP_OUTERMOST) == 1
        assert ranks_per_node(layout, H100, PP_OUTERMOST) == 8 // tp
    assert bandwidth(config(2, 4, 8), H100, PIPECLOCK) == H100.inter_node_bandwidth
    assert bandwidth(config(2, 4, 8), H100, FRAMEWORKS) == 4 * H100.inter_node_bandwidth
    assert ranks_per_node(config(2, 2, 16), H100, DP_OUTERMOST) == 2  # two pipelines of 4 a node


def test_a_pipeline_inside_one_node_sends_its_stage_messages_over_nvlink():
    inside, spanning = config(tp=2, pp=4, dp=8), config(tp=4, pp=4, dp=4)
    assert not message_crosses_nodes(inside, H100, DP_OUTERMOST)
    assert message_crosses_nodes(inside, H100, PP_OUTERMOST)  # stages dp x tp = 16 ranks apart
    assert message_crosses_nodes(spanning, H100, DP_OUTERMOST)  # 16 ranks a pipeline: two nodes
    job = Job(64, 2048)
    ours, theirs = (message_seconds(MODEL, inside, job, Rates(H100, s)) for s in (PIPECLOCK, FRAMEWORKS))
    assert ours < theirs


def test_with_dp_outermost_a_group_lies_in_one_node_only_when_the_pipelines_do():
    assert group_in_one_node(config(1, 4, 4), H100, PP_OUTERMOST)  # a stage's 4 replicas, one node
    assert not group_in_one_node(config(1, 4, 4), H100, DP_OUTERMOST)  # its replicas 4 ranks apart
    assert group_in_one_node(config(2, 8, 1, cp=2), H100, DP_OUTERMOST)  # dp 1: the cp pair, 2 apart


def test_the_plans_header_names_pipeclocks_order_and_not_the_default():
    cluster, job = Cluster(16, H100), Job(64, 2048)
    assert "dp outermost" in cluster_report.header(MODEL, cluster, job, PIPECLOCK)[0]
    assert "outermost" not in cluster_report.header(MODEL, cluster, job, FRAMEWORKS)[0]


def test_every_published_row_lays_its_ranks_as_its_framework_does():
    pytest.importorskip("transformers")
    from benchmarks import cluster_check

    orders = {(row.source, row.software.rank_order) for row in cluster_check.rows()}
    meta = {order for source, order in orders if source.startswith("Meta")}
    assert meta == {DP_OUTERMOST}  # Llama 3 §3.3.2: [TP, CP, PP, DP], dp outermost
    assert {order for source, order in orders if not source.startswith("Meta")} == {PP_OUTERMOST}
