"""The cluster planner against published A100 runs (benchmarks/published_a100.py, docs/cluster.md): each
quoted figure read back as its source counts it, the A100 kinds' own constant, attention without a
flash-style kernel, Megatron's split stage-to-stage messages, the runs predicted within the target, and
what sequence parallel with selective recompute costs against what Korthikanti et al. 2022 measured."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeclock.plan import calibration
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_time import Rates, layer_time, message_seconds
from pipeclock.plan.gpus import KINDS
from pipeclock.plan.paper_model import PaperModel

GPT = PaperModel("test GPT", layers=4, hidden=2048, heads=16, kv_heads=16, head_dim=128, ffn=8192,
                 vocab=51200)  # fmt: skip
A100 = KINDS["A100-80GB"]


def config(tp=1, pp=1, sp=False, recompute="none", mbs=2) -> Config:
    return Config(tp, pp, 1, "1f1b", 1, mbs, 1, recompute, 0, sp)


def test_table_1s_teraflops_are_read_back_by_the_papers_own_count_of_four_passes():
    from benchmarks.published_a100 import narayanan_tokens_per_gpu

    # 1T GPT (Table 1): 163 TFLOP/s on 3,072 GPUs is 502 PFLOP/s; Eq. 3 counts 96 B s l h^2 (...) an iteration
    tokens = narayanan_tokens_per_gpu(163, layers=128, hidden=25600, seq=2048, vocab=51200)
    per_token = 96 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert tokens * per_token == pytest.approx(163e12)
    assert tokens * per_token * 3072 / 1e15 == pytest.approx(502.0, rel=0.005)


def test_the_runs_models_on_paper_are_what_their_hugging_face_configs_read_as():
    transformers = pytest.importorskip("transformers")
    from benchmarks.published_a100 import paper, runs
    from pipeclock.plan.hf_paper import paper_model

    gpt, bloom = runs()[0], next(run for run in runs() if run.model[0] == "bloom")
    _, heads, hidden, layers, vocab = gpt.model
    config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab,
                                     n_positions=gpt.seq_len)  # fmt: skip
    assert paper(gpt) == paper_model(config, gpt.name)
    _, heads, hidden, layers, vocab = bloom.model
    config = transformers.BloomConfig(hidden_size=hidden, n_layer=layers, n_head=heads, vocab_size=vocab)
    assert paper(bloom) == paper_model(config, "BLOOM 176B")


def test_the_a100s_take_their_own_constant_and_the_kinds_without_runs_the_h100s():
    for name in ("A100-40GB", "A100-80GB"):
        assert KINDS[name].gemm_efficiency == calibration.A100_GEMM_EFFICIENCY
    for name in ("H100-80GB", "H200", "L40S", "RTX4090", "MI300X"):
        assert KINDS[name].gemm_efficiency == calibration.H100_GEMM_EFFICIENCY


def test_a_materialized_score_matrix_costs_its_bytes_forward_twice_backward_and_again_under_recompute():
    job, rates = Job(8, 2048), Rates(A100, Software("bf16"))
    for tp, recompute in ((1, "none"), (4, "none"), (4, "full"), (2, "selective-attention")):
        materialized = Software("bf16", attention="materialized")
        flash = layer_time(GPT, config(tp, recompute=recompute), job, Software("bf16"), rates)
        plain = layer_time(GPT, config(tp, recompute=recompute), job, materialized, rates)
        square = calibration.SCORE_BYTES * 2 * GPT.heads / tp * 2048**2 / A100.memory_bandwidth
        again = 0.0 if recompute == "none" else square
        assert plain.forward - flash.forward == pytest.approx(square)
        assert plain.input_grad - flash.input_grad == pytest.approx(2 * square + again)
        assert plain.weight_grad == flash.weight_grad


def test_an_unknown_attention_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown attention kernel 'sdpa': use flash or materialized"):
        Software("bf16", attention="sdpa")


def test_refitting_a_constant_that_is_not_fitted_is_refused_in_one_line(capsys):
    from benchmarks import cluster_check

    with pytest.raises(SystemExit) as exit_:
        cluster_check.main(["--fit", "A100_GEMM_EFFICIENCY,A100_EFFICIENCY"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    fitted = ", ".join(cluster_check.FITTED)
    assert last.endswith(f"error: --fit A100_EFFICIENCY: the fitted constants are {fitted}")


def test_without_sequence_parallel_a_stage_sends_its_tp_share_and_gathers_the_rest_on_its_node():
    job, rates = Job(8, 2048), Rates(A100, Software("bf16"))
    whole = 2 * 2048 * GPT.hidden * 2  # one micro-batch's activation, bf16
    network = A100.inter_node_bandwidth * calibration.LINK_EFFICIENCY
    node = A100.intra_node_bandwidth * calibration.LINK_EFFICIENCY
    latency = calibration.COLLECTIVE_LATENCY
    across = config(tp=8, pp=4)  # 32 GPUs: every stage boundary crosses nodes
    assert message_seconds(GPT, across, job, rates) == pytest.approx(
        latency + whole / 8 / network + latency + whole * 7 / 8 / node
    )
    assert message_seconds(GPT, replace(across, sequence_parallel=True), job, rates) == pytest.approx(
        latency + whole / 8 / network
    )
    assert message_seconds(GPT, config(tp=1, pp=4), job, rates) == pytest.approx(latency + whole / node)


# the runs whose search takes under a second (the 310B, 530B and 1T GPTs of Table 1 take seconds each),
# each held to the target, 10 %: Megatron-LM's own runs, and DeepSpeed's (BLOOM, MT-NLG), which take
# `DEEPSPEED_SHARE` (fitted on MT-NLG's 350-server run, checked on these)
QUICK = {"GPT 1.7B": 0.10, "GPT 18.4B": 0.10, "GPT 145.6B": 0.10, "GPT 22B, full recompute": 0.10,
         "GPT 22B, sp + selective": 0.10, "tp 4 x pp 12 x dp 8": 0.10, "280 DGX servers": 0.10,
         "420 DGX servers": 0.10}  # fmt: skip


def test_the_published_a100_runs_are_predicted_within_the_target():
    from benchmarks import cluster_check

    rows = [row for row in cluster_check.a100_rows() if row.name in QUICK]
    assert sorted(row.name for row in rows) == sorted(QUICK)
    for row in rows:
        row.predicted = cluster_check.predict(row)
        speed, _ = cluster_check.errors(row)
        assert row.predicted["fits"], f"{row.source} {row.name} fits as it ran"
        assert abs(speed) <= QUICK[row.name], f"{row.source} {row.name}: {speed:+.1%}"


POLICIES = ("full recompute", "sp + selective")  # Korthikanti et al.'s two columns, as the rows name them


def test_korthikantis_seconds_give_back_its_own_utilization_and_speed_ups():
    from benchmarks.published_a100 import A100_PEAK, korthikanti_model_flops, runs

    # Table 5's MFU (its seconds with Table 3's batch, by Eq. 7), section 6.3's 54.2 % at dp 8, the
    # abstract's 42.1 % with full recompute; Table 5's throughput increase over full recompute
    mfu = {"GPT 22B, sp + selective": 0.415, "GPT 175B, sp + selective": 0.514,
           "GPT 530B, sp + selective": 0.560, "GPT 1T, sp + selective": 0.563,
           "GPT 530B dp 8, sp + selective": 0.542, "GPT 530B dp 8, full recompute": 0.421}  # fmt: skip
    increase = {"GPT 22B": 0.290, "GPT 175B": 0.318, "GPT 530B": 0.297, "GPT 1T": 0.321}
    published = {run.name: run for run in runs() if run.source.startswith("Korthikanti")}
    for name, utilization in mfu.items():
        run = published[name]
        _, _, hidden, layers, vocab = run.model
        flops = run.tokens_per_gpu * korthikanti_model_flops(layers, hidden, run.seq_len, vocab)
        assert flops / A100_PEAK == pytest.approx(utilization, abs=0.003), name
    for size, faster in increase.items():
        full, present = (published[f"{size}, {policy}"].tokens_per_gpu for policy in POLICIES)
        assert present / full - 1 == pytest.approx(faster, abs=0.001), size


def test_a_22b_layer_costs_what_korthikantis_table_4_measured_under_each_recompute_policy():
    from benchmarks.published_a100 import paper, runs

    # Table 4: one layer of the 22B GPT (tp 8, 4 sequences of 2,048), forward plus backward in ms
    measured = {("none", False): 19.6, ("none", True): 19.0, ("full", False): 27.2,
                ("selective-attention", False): 20.9, ("selective-attention", True): 20.3}  # fmt: skip
    run = next(run for run in runs() if run.name == "GPT 22B, sp + selective")
    software = Software("bf16", fused=True, attention="materialized", tp_backward_overlap=True)
    rates, job = Rates(A100, software), Job(run.global_batch, run.seq_len)

    def seconds(recompute: str, sp: bool) -> float:
        layer = layer_time(paper(run), config(8, 1, sp, recompute, mbs=4), job, software, rates)
        return layer.forward + layer.input_grad + layer.weight_grad

    baseline = seconds("none", False)
    for (recompute, sp), ms in measured.items():
        # each policy's cost over the plain layer's, within 4 points, with the backward's tp all-reduce
        # under the weight gradients as Megatron-LM runs it (section 6.2)
        overhead = seconds(recompute, sp) / baseline - 1
        assert overhead == pytest.approx(ms / measured[("none", False)] - 1, abs=0.04), (recompute, sp)


def test_sequence_parallel_with_selective_recompute_is_as_much_faster_as_korthikanti_measured():
    from benchmarks import cluster_check

    rows = {row.name: row for row in cluster_check.a100_rows() if row.source.startswith("Korthikanti")}
    for size, published in (("GPT 22B", 0.290), ("GPT 175B", 0.318)):  # Table 5; the larger take seconds
        # within 2.5 points: Table 4's own layers differ by 34 % (27.2 ms against 20.3), the steps by 29 %
        full, present = (cluster_check.predict(rows[f"{size}, {policy}"]) for policy in POLICIES)
        assert present["tokens"] / full["tokens"] - 1 == pytest.approx(published, abs=0.025), size
