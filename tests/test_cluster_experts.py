"""The cluster planner with expert parallel: experts' states divided by ep, the all-to-all on the link it
crosses, ep among the knobs with its refusals, and a published MoE run predicted within 20 %."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeclock.plan import experts
from pipeclock.plan.cluster_config import DP_OUTERMOST, PP_OUTERMOST, Config, Job, Software
from pipeclock.plan.cluster_memory import gpu_memory
from pipeclock.plan.gpus import KINDS, Cluster
from pipeclock.plan.paper_model import PaperModel
from pipeclock.plan.search import SearchError, search

# a Mixtral-shaped mixture, small: 8 experts, top 2
MOE = PaperModel("test MoE", layers=8, hidden=1024, heads=8, kv_heads=8, head_dim=128, ffn=2048, vocab=32000,
                 experts=8, experts_per_token=2)  # fmt: skip
DENSE = replace(MOE, name="test dense", experts=0, experts_per_token=0)
H100 = KINDS["H100-80GB"]
JOB = Job(64, 2048)


def config(ep: int, dp: int = 8, tp: int = 1, zero: int = 0) -> Config:
    return Config(tp, 2, dp, "1f1b", 1, 1, JOB.global_batch // dp, "none", zero, False, ep)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_each_ranks_expert_weights_gradients_and_optimizer_state_are_divided_by_ep(zero):
    whole = gpu_memory(MOE, config(1, zero=zero), JOB, Software("bf16"))
    split = gpu_memory(MOE, config(4, zero=zero), JOB, Software("bf16"))
    routed = 4 * experts.routed_parameters(MOE)  # four layers a stage
    moved = routed * (1 - 1 / 4)
    assert whole.weights - split.weights == pytest.approx(2 * moved)  # the bf16 copy
    # ZeRO-2 shards the gradients 1/dp without ep, and 1/ep's over dp/ep ranks with it: the same bytes
    assert whole.gradients - split.gradients == pytest.approx(moved * 4 if zero < 2 else 0.0)
    state = 12 * (routed - routed / 4) if zero == 0 else 0.0  # sharded: 1/dp either way
    assert whole.optimizer - split.optimizer == pytest.approx(state)
    assert whole.activations == split.activations


def test_the_all_to_all_crosses_nvlink_inside_a_node_and_the_network_past_it():
    bf16 = Software("bf16", rank_order=PP_OUTERMOST)  # the ep ranks tp apart
    inside = experts.exchange(MOE, config(8, dp=8), JOB, bf16, H100)
    assert inside.between == 0 and inside.inside == pytest.approx(2 * 7 / 8)  # top 2, 7 of 8 ranks away
    across = experts.exchange(MOE, replace(config(8, dp=16), tp=2), JOB, bf16, H100)  # 4 ranks a node
    assert across.between == pytest.approx(2 * 4 / 8) and across.inside == pytest.approx(2 * 3 / 8)
    tokens = JOB.seq_len / 2  # a micro-batch's sequence, its half on each tp rank
    volume = across.between * tokens * MOE.hidden * 2
    network = H100.inter_node_bandwidth * 0.8
    assert across.forward == pytest.approx(2 * (volume / network + 20e-6))  # dispatch and combine
    assert across.backward == across.forward
    assert experts.exchange(MOE, config(1), JOB, bf16, H100) == experts.NO_EXCHANGE


def test_under_pipeclocks_order_the_ep_ranks_sit_a_pipeline_apart():
    pipeclock = Software("bf16", rank_order=DP_OUTERMOST)
    spread = experts.exchange(MOE, config(8, dp=8), JOB, pipeclock, H100)  # pp 2: 2 ranks apart
    assert spread.between == pytest.approx(2 * 4 / 8) and spread.inside == pytest.approx(2 * 3 / 8)


def test_under_fp8_the_tokens_go_to_their_experts_in_one_byte_and_come_back_in_two():
    fp8 = experts.exchange(MOE, config(8), JOB, Software("fp8"), H100)
    bf16 = experts.exchange(MOE, config(8), JOB, Software("bf16"), H100)
    assert fp8.bytes_forward / bf16.bytes_forward == pytest.approx((1 + 2) / (2 + 2))


def test_node_limited_routing_crosses_the_network_once_per_node_a_token_needs():
    limited = replace(MOE, experts=64, experts_per_token=8, expert_groups=8, groups_per_token=4)
    inside, between = experts.copies(limited, 64, 1, H100)
    assert between == pytest.approx(4 * 7 / 8)  # four nodes at most, one of them maybe its own
    assert inside == pytest.approx(8 * 63 / 64)  # every copy away crosses NVLink, sent or forwarded


def test_ep_is_a_knob_the_search_tries_on_divisors_of_dp_and_the_experts():
    found = search(MOE, Cluster(16, H100), JOB, Software("bf16"), {"pp": 2, "dp": 8}, top=3)
    assert {p.config.ep for p in found.ranked} <= {1, 2, 4, 8}
    fixed = search(MOE, Cluster(16, H100), JOB, Software("bf16"), {"pp": 2, "ep": 4}, top=1)
    assert fixed.ranked[0].config.ep == 4 and fixed.ranked[0].as_json()["ep"] == 4
    assert "(ep 4)" in fixed.ranked[0].config.label()
    dense = search(DENSE, Cluster(16, H100), JOB, Software("bf16"), {"pp": 2}, top=3)
    assert {p.config.ep for p in dense.ranked} == {1}


@pytest.mark.parametrize(
    ("model", "fixed", "message"),
    [
        (DENSE, {"ep": 2}, "--fix ep=2: test dense is dense: expert parallel needs a mixture of experts"),
        (MOE, {"ep": 3}, "--fix ep=3 does not divide the model's 8 experts"),
        (MOE, {"ep": 4, "dp": 2}, "--fix ep=4 does not divide dp=2: the expert groups are carved from"),
    ],
)
def test_an_ep_that_cannot_work_is_refused_in_one_line(model, fixed, message):
    with pytest.raises(SearchError, match="^" + message.replace("(", r"\(")):
        search(model, Cluster(16, H100), JOB, Software("bf16"), fixed, top=1)


def test_deepseek_v3_pre_training_is_predicted_within_20_percent_of_its_published_throughput():
    pytest.importorskip("transformers")
    from benchmarks.moe_check import PUBLISHED_TOKENS_PER_GPU, ROWS, predict

    assert pytest.approx(1543.2, abs=0.1) == PUBLISHED_TOKENS_PER_GPU  # 180K H800 GPU-hours a trillion
    chosen = ",microbatch-size=1,recompute=selective-op"  # what the search picks (benchmarks.moe_check)
    best = predict(replace(ROWS[0], fix=ROWS[0].fix + chosen))
    assert best.fits and (best.config.pp, best.config.ep, best.config.dp) == (16, 64, 128)
    assert abs(best.tokens_per_second_per_gpu / PUBLISHED_TOKENS_PER_GPU - 1) < 0.20
    assert not predict(replace(ROWS[2], fix=ROWS[2].fix + chosen)).fits  # its experts fill an 80 GB H800


def test_deepseek_v3_on_paper_has_its_published_671b_parameters_and_three_dense_first_blocks():
    """The report's 671B (arXiv 2412.19437, abstract): its first three blocks' dense MLPs (18,432 wide)
    counted as such, not as 256 experts each; their costs are a dense block's, without all-to-all."""
    pytest.importorskip("transformers")
    from benchmarks.moe_check import CONFIGS
    from pipeclock.plan.hf_paper import paper_model, read_config

    model = paper_model(read_config(CONFIGS / "deepseek-v3.json"))
    assert (model.dense_layers, model.dense_ffn) == (3, 18432)
    assert abs(model.parameters() / 671e9 - 1) < 0.01
    twin = model.dense_twin()
    assert not twin.is_moe and model.dense_among(range(0, 4)) == 3 and model.dense_among(range(4, 8)) == 0
    config = Config(1, 16, 128, "1f1b", 1, 1, 8, "none", 1, False, ep=64)
    assert experts.exchange(twin, config, Job(15360, 4096), Software("fp8"), KINDS["H100-80GB"]).forward == 0


def test_plan_refuses_ep_on_a_dense_model_in_one_line_and_exit_code_2(monkeypatch, capsys):
    import sys

    from pipeclock.cli.dispatch import main

    monkeypatch.setattr(sys, "argv", ["pipeclock", "plan"])
    code = main(["plan", "--cluster", "8xH100-80GB", "--params", "1e9", "--fix", "ep=2"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    dense = "--fix ep=2: a 1B-parameter model is dense: expert parallel needs a mixture of experts"
    assert err == f"pipeclock plan: error: {dense}\n"


def test_latent_attention_on_paper_has_the_parameters_and_products_of_deepseeks_own_layer():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from pipeclock.plan import latent_attention
    from pipeclock.plan.hf_paper import paper_model

    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1, num_hidden_layers=2, vocab_size=100, n_group=4,
        topk_group=2,
    )  # fmt: skip
    with torch.device("meta"):
        layer = DeepseekV3Attention(config, 0)
    model = paper_model(config)
    products = model.gemms()
    weights = {name.removesuffix(".weight"): p for name, p in layer.named_parameters() if p.dim() == 2}
    shapes = {
        "q_a": "q_a_proj",
        "q_b": "q_b_proj",
        "kv_a": "kv_a_proj_with_mqa",
        "kv_b": "kv_b_proj",
        "o": "o_proj",
    }
    for gemm in products[:5]:
        assert tuple(weights[shapes[gemm.role]].shape) == (gemm.n, gemm.k), gemm
    norms = latent_attention.norm_parameters(model.q_lora, model.kv_lora, 1)
    assert sum(g.k * g.n for g in products[:5]) + norms == sum(p.numel() for p in layer.parameters())
    assert model.q_dim == 4 * (8 + 4 + 8) // 2  # scores over 12 per head, values 8
    assert (model.shared_ffn, model.expert_groups, model.groups_per_token) == (16, 4, 2)
