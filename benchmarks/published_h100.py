"""Published H100 runs of Meta and NVIDIA, as rows of `benchmarks.cluster_check`'s table.

Sources, every figure quoted as printed:

- Meta, "The Llama 3 Herd of Models" (arXiv 2407.21783v3), §3.3 and Table 4: Llama 3 405B on 8,192 and
  16,384 H100 SXMs (700 W, 80 GB HBM3, 8 a server on NVLink, 400 Gb/s RoCE), bf16, tp 8 x pp 16 x dp 64
  (32 sequences of 8,192 tokens per dp rank) and x dp 128 (16 per rank), the interleaved schedule,
  "sequences of 8K tokens without activation checkpointing"; §3.3.2: "Our use of FSDP for Llama 3 shards
  optimizer states and gradients, but for model shards we do not reshard after forward computation" (torch's
  ``SHARD_GRAD_OP``, ``torch/distributed/fsdp/api.py``: ``zero=2``), and "we reduce one Transformer layer
  each from the first and the last stages ... the first model chunk on the first stage has only the
  embedding, and the last model chunk on the last stage has only output projection and loss calculation"
  (``ends=slot``; for 126 layers on pp 16, one layer a chunk: V = 8, which the search picks);
  TFLOP/s per GPU 430 and 400 (BF16 MFU 43 % and 41 %, MFU as PaLM counts it: the whole attention square,
  as `PaperModel.model_flops_per_token`). Table 4's third row: 16,384 GPUs, tp 8, cp 16, pp 16, 16
  sequences of 131,072 tokens per dp rank, 16M tokens a batch, 380 TFLOP/s; it prints DP 4, which makes
  neither the GPUs (8 x 16 x 16 x 4 = 8,192) nor the batch (8.4M tokens): dp 8 makes both. Its context
  parallel all-gathers the keys and values with the latency "exposed in the critical path" (§3.3.2):
  ``cp_exchange="all-gather-exposed"``; its recompute is not stated (the search's).
- NVIDIA NeMo, ``docs/source/performance/performance_summary.md`` (NVIDIA/NeMo, its last version, commit
  8e3d65dc "24.07 perf numbers", 2024-09-09): pre-training at FP8 on DGX-H100 with the NeMo 24.07
  container (Megatron-Core, Transformer Engine), GBS, MBS, sequence, TP, PP, CP and VP per row,
  tokens/s per GPU. The models are NeMo's own configs at that commit
  (``nemo/collections/llm/gpt/model/base.py``: GPT-3 5B, 20B, 175B with learned positions, LayerNorm,
  GELU, biases and tied embeddings; ``llama.py``: Llama 2 7B, 13B, 70B), the vocabulary padded as
  Megatron pads it (to a multiple of 128 x tp: GPT-2's 50,257 tokens, Llama 2's 32,000, Llama 3's 128,256;
  ``llama.py``'s Llama3Config8B and 70B are the Llama 3.1 configs' shapes). Its Nemotron rows (squared-ReLU
  Nemotron, a family the planner does not read) are left out; its Llama 3 rows run cp 2, as Megatron-Core
  runs context parallel with Transformer Engine: a ring (``cp_exchange="ring"``).
- NVIDIA Megatron-Bridge, ``docs/performance-summary-archive.md`` (NVIDIA-NeMo/Megatron-Bridge, read at
  commit 067f987d, 2026-08-22): DGX-H100 pre-training of Llama 3 8B and 70B (docs/cluster's Llama 3.1
  configs: the same shapes) in FP8 with current scaling, containers 25.11 and 26.04, with FSDP, TP, PP,
  CP, VP, GBS, MBS per row and tokens/s per GPU. Its Llama 3.1 405B H100 rows use cp 2 and are left out,
  as are its mixtures (GPT-OSS, Qwen3 MoE: families or token balancing the planner does not model).

- What the NVIDIA runs keep in fp8 (`cluster_config.FP8_KEEPS`): Transformer Engine keeps each fp8
  product's input as its fp8 cast. Megatron-Bridge's H100 FP8-CS configs take
  ``bf16_with_fp8_current_scaling_mixed`` (``src/megatron/bridge/training/mixed_precision.py``:
  ``fp8_param_gather = True``, fp8 weights) and set no recompute for the 70B, where they set it for the 8B
  (``scripts/performance/configs/llama3/workload_base_configs.py`` at tag v0.2.0, 2025-11-26;
  ``scripts/performance/configs/llama/llama3_workload_base_configs.py`` at v0.3.0; and
  ``src/megatron/bridge/perf_recipes/llama/h100/llama3.py`` at 067f987d): fp8 weights, recompute none.
  NeMo's 512-GPU GPT3-175B row is NeMo-Framework-Launcher's ``launcher_scripts/conf/training/gpt3/
  175b_mlperf.yaml`` (NVIDIA/NeMo-Framework-Launcher, added in 121c975d, 2024-07-18): 64 nodes, tp 4,
  pp 8, vp 6, MBS 2, GBS 2048, fp8 with no activation checkpointing (``activations_checkpoint_granularity:
  null``), and ``fp8_params: true`` since 7316a8d9 (2024-09-10, "Update 175B mlperf config", the day after
  the table's commit). NeMo's other rows state neither; they are taken with fp8 weights too, since NeMo's
  default (``fp8_params`` off: bf16 weights with TE's fp8 copies beside them) cannot give their published
  speeds: with it, the planner's best for GPT3-20B on 64 GPUs reads -68 % and GPT3-175B on 128 GPUs
  must recompute (-8 %).

What a source does not state (recompute and ZeRO stage of NeMo's other runs, sequence parallel, the
micro-batch of Meta's runs and the chunks of its interleaving) is left to the search. Meta's N (micro-batches
a round, §3.3.2: tunable) is not stated for these runs; the published orders that take it (Megatron-LM's
``megatron/core/pipeline_parallel/schedules.py`` at 00611e6e, N in [PP, M]; torch's
``ScheduleInterleaved1F1B``, N = M / max(1, M // PP)) give N = PP = 16 here, the planner's rounds.
Meta's cp row takes the same FSDP and ends (§3.3.2 states them for the run, not per table row).
Meta lays its ranks in the order [TP, CP, PP, DP] (§3.3.2, innermost first): dp outermost, as pipeclock
(``rank_order=DP_OUTERMOST``); NVIDIA's runs lay them as Megatron-Core does, pp outermost. With tp 8 the
two orders give Meta's rows the same links.
Overlapping tensor parallel's collectives is stated in no table: NVIDIA's runs are taken as overlapped
(Megatron-Core's ``tp_comm_overlap``, which NeMo's and Megatron-Bridge's H100 recipes configure, e.g.
Megatron-Bridge's ``src/megatron/bridge/perf_recipes/llama/h100/llama3.py``), Meta's as not (with
``--tp-overlap`` the planner reads them 8 % faster).
"""

from __future__ import annotations

META = "Meta, Llama 3 Table 4"
NEMO = "NeMo 24.07 FP8"
BRIDGE = "Megatron-Bridge FP8"

# (GPUs, tp, pp, dp, sequences per dp rank, TFLOP/s per GPU, role)
META_ROWS = [
    (8192, 8, 16, 64, 32, 430, "check"),
    (16384, 8, 16, 128, 16, 400, "check"),
]
META_SEQ = 8192
# (GPUs, tp, cp, pp, dp, sequences per dp rank, sequence, TFLOP/s per GPU, role)
META_CP_ROWS = [(16384, 8, 16, 16, 8, 16, 131072, 380, "check")]
# (model, GPUs, GBS, MBS, sequence, tp, pp, vp, tokens/s per GPU, role); all cp 1
NEMO_ROWS = [
    ("GPT3-5B", 64, 2048, 4, 2048, 1, 1, 1, 23406, "check"),
    ("GPT3-20B", 64, 256, 2, 2048, 2, 1, 1, 5851, "check"),
    ("GPT3-175B", 128, 256, 1, 2048, 4, 8, 6, 716, "fit"),
    ("GPT3-175B", 512, 2048, 2, 2048, 4, 8, 6, 825, "check"),
    ("LLAMA2-7B", 8, 128, 1, 4096, 1, 1, 1, 16934, "check"),
    ("LLAMA2-13B", 16, 128, 1, 4096, 1, 4, 10, 8715, "check"),
    ("LLAMA2-70B", 64, 128, 1, 4096, 4, 4, 20, 1728, "fit"),
]
# (container, Llama 3 size, GPUs, GBS, MBS, FSDP, tp, pp, vp, tokens/s per GPU, role); sequences of 8,192
BRIDGE_ROWS = [
    ("25.11", "8b", 8, 128, 1, 8, 1, 1, 1, 14451, "check"),
    ("25.11", "70b", 64, 128, 1, 0, 4, 8, 5, 1602, "check"),
    ("26.04", "70b", 64, 256, 1, 0, 4, 8, 5, 1633, "check"),
]
BRIDGE_SEQ = 8192
# NeMo rows whose launcher config is known (the module's list): (model, GPUs) -> its fixed knobs
NEMO_KNOWN = {("GPT3-175B", 512): ",recompute=none"}
# NeMo's configs: (layers, hidden, ffn, heads, kv heads)
SHAPES = {
    "GPT3-5B": (24, 4096, 16384, 32, 32),
    "GPT3-20B": (44, 6144, 24576, 48, 48),
    "GPT3-175B": (96, 12288, 49152, 96, 96),
    "LLAMA2-7B": (32, 4096, 11008, 32, 32),
    "LLAMA2-13B": (40, 5120, 13824, 40, 40),
    "LLAMA2-70B": (80, 8192, 28672, 64, 8),
}
# (model, GPUs, GBS, MBS, sequence, tp, pp, cp, vp, tokens/s per GPU, role)
NEMO_CP_ROWS = [
    ("LLAMA3-8B", 8, 128, 1, 8192, 1, 1, 2, 1, 12273, "check"),
    ("LLAMA3-70B", 64, 128, 1, 8192, 4, 4, 2, 5, 1524, "check"),
]
SHAPES |= {"LLAMA3-8B": (32, 4096, 14336, 32, 8), "LLAMA3-70B": (80, 8192, 28672, 64, 8)}
GPT2_VOCAB, LLAMA2_VOCAB, LLAMA3_VOCAB = 50257, 32000, 128256


def rows() -> list:
    """The rows above as `cluster_check.Row`s."""
    from benchmarks.cluster_check import CONFIGS, Row
    from pipeclock.cli.plan_cluster import parse_fix
    from pipeclock.plan.cluster_config import DP_OUTERMOST, PP_OUTERMOST, Job, Software
    from pipeclock.plan.gpus import KINDS, Cluster
    from pipeclock.plan.hf_paper import paper_model, read_config

    h100 = KINDS["H100-80GB"]
    result = []
    llama = paper_model(read_config(CONFIGS / "llama-3.1-405b.json"), "Llama 3 405B")
    metas = "zero=2,schedule=interleaved-1f1b,ends=slot"  # its FSDP, its pipeline's ends
    meta = Software("bf16", True, False, rank_order=DP_OUTERMOST)
    for gpus, tp, pp, dp, per_rank, tflops, role in META_ROWS:
        fixed = parse_fix(f"tp={tp},pp={pp},dp={dp},recompute=none,{metas}")
        result.append(Row(META, f"Llama 3 405B, {gpus:,} GPUs", llama, Cluster(gpus, h100),
                          Job(dp * per_rank, META_SEQ), meta, fixed, None, tflops, None,
                          role))  # fmt: skip
    for gpus, tp, cp, pp, dp, per_rank, seq, tflops, role in META_CP_ROWS:
        fixed = parse_fix(f"tp={tp},cp={cp},pp={pp},dp={dp},{metas}")
        software = Software("bf16", True, False, cp_exchange="all-gather-exposed", rank_order=DP_OUTERMOST)
        result.append(Row(META, f"Llama 3 405B, {gpus:,} GPUs, cp {cp}, seq {seq:,}", llama,
                          Cluster(gpus, h100), Job(dp * per_rank, seq), software, fixed, None, tflops, None,
                          role))  # fmt: skip
    nemo = [(*row[:7], 1, *row[7:]) for row in NEMO_ROWS] + NEMO_CP_ROWS  # cp 1, then the cp 2 rows
    for name, gpus, batch, mbs, seq, tp, pp, cp, vp, tokens, role in nemo:
        schedule = ",schedule=1f1b" if pp > 1 else ""
        schedule = f",schedule=interleaved-1f1b,chunks={vp}" if vp > 1 else schedule
        known = NEMO_KNOWN.get((name, gpus), "")
        degrees = f"tp={tp},pp={pp},dp={gpus // (tp * pp * cp)}" + (f",cp={cp}" if cp > 1 else "")
        fixed = parse_fix(f"{degrees},microbatch-size={mbs}{schedule}{known}")
        label = f"{name}, {gpus} GPUs" + (f", cp {cp}" if cp > 1 else "")
        software = Software(
            "fp8", True, True, fp8="te-fp8-params", cp_exchange="ring", rank_order=PP_OUTERMOST
        )
        result.append(Row(NEMO, label, nemo_model(name, tp, seq), Cluster(gpus, h100), Job(batch, seq),
                          software, fixed, tokens, None, None, role))  # fmt: skip
    for container, size, gpus, batch, mbs, fsdp, tp, pp, vp, tokens, role in BRIDGE_ROWS:
        model = paper_model(read_config(CONFIGS / f"llama-3.1-{size}.json"), f"Llama 3 {size.upper()}")
        schedule = f",schedule=interleaved-1f1b,chunks={vp}" if vp > 1 else ""
        zero = ",zero=3" if fsdp else ""
        recompute = ",recompute=none" if size == "70b" else ""  # the 8B's recomputes 5 layers of each stage
        fixed = parse_fix(f"tp={tp},pp={pp},dp={gpus // (tp * pp)},microbatch-size={mbs}{zero}{schedule}"
                          f"{recompute}")  # fmt: skip
        software = Software("fp8", True, True, fp8="te-fp8-params", rank_order=PP_OUTERMOST)
        result.append(Row(BRIDGE, f"Llama 3 {size.upper()}, {gpus} GPUs, GBS {batch} ({container})", model,
                          Cluster(gpus, h100), Job(batch, BRIDGE_SEQ), software, fixed, tokens, None, None,
                          role))  # fmt: skip
    return result


def nemo_model(name: str, tp: int, seq: int):
    """NeMo's config of ``name`` as a `PaperModel`, its vocabulary padded for ``tp``."""
    from transformers import GPT2Config, LlamaConfig

    from pipeclock.plan.hf_paper import paper_model

    layers, hidden, ffn, heads, kv_heads = SHAPES[name]
    if name.startswith("GPT3"):
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, n_positions=seq,
                            vocab_size=padded(GPT2_VOCAB, tp), tie_word_embeddings=True)  # fmt: skip
    else:
        vocab = LLAMA3_VOCAB if name.startswith("LLAMA3") else LLAMA2_VOCAB
        config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, intermediate_size=ffn,
                             vocab_size=padded(vocab, tp), tie_word_embeddings=False)  # fmt: skip
    return paper_model(config, name)


def padded(vocab: int, tp: int) -> int:
    """Megatron's padding: the vocabulary up to a multiple of 128 x tp."""
    step = 128 * tp
    return -(-vocab // step) * step
