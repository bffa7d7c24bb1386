"""torchtitan's and Megatron-LM's published H100 runs of 2024, as rows of `benchmarks.cluster_check`'s table.

Sources:
- torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` at commit 31a17bfd (pytorch/torchtitan),
  runs of torchtitan 9dec370 (2024-12-26), whose ``train_configs/llama3_*.toml`` give seq_len 8192 and
  whose pipeline default is as many micro-batches as stages; the GPUs are H100s with 96 GB of HBM2e at
  2.4 TB/s and a 500 W power limit (docs/cluster/h100-96gb-500w.json); memory is the peak reserved.
- Megatron-LM, README "Training Speed and Scalability" table (``images/model_table.png``, added in
  commit f2e5db40, 2024-07-15): GPT models, vocabulary 131,072, sequences of 4,096, on H100 SXMs, with
  data-, tensor- and pipeline-parallel communication overlapped; TFLOP/s per GPU as Megatron-LM counts
  them (``num_floating_point_operations``), the count `PaperModel.model_flops_per_token` follows.
"""

from __future__ import annotations

import dataclasses

from pipeclock.plan.cluster_config import PP_OUTERMOST, Job, Software
from pipeclock.plan.gpus import KINDS, Cluster, load_spec
from pipeclock.plan.hf_paper import paper_model, read_config

TITAN = "torchtitan"
MEGATRON = "Megatron-LM"
# (source, table, row, model, gpus, global batch, seq len, software, fixed knobs,
#  published tokens/s per GPU or None, published TFLOP/s per GPU or None, published GiB or None, role)
TITAN_ROWS = [
    (
        "T1",
        "FSDP",
        "8b",
        8,
        16,
        8192,
        ("bf16", False, False),
        "dp=8,tp=1,pp=1,zero=3,microbatch-size=2,recompute=selective-op",
        5762,
        82.4,
        "fit",
    ),
    (
        "T1",
        "FSDP + compile",
        "8b",
        8,
        16,
        8192,
        ("bf16", True, False),
        "dp=8,tp=1,pp=1,zero=3,microbatch-size=2,recompute=selective-op",
        6667,
        77.0,
        "fit",
    ),
    (
        "T1",
        "FSDP + compile + Float8",
        "8b",
        8,
        16,
        8192,
        ("fp8", True, False),
        "dp=8,tp=1,pp=1,zero=3,microbatch-size=2,recompute=selective-op",
        8532,
        76.8,
        "fit",
    ),
    (
        "T2",
        "FSDP 8, CP 1, seq 32768",
        "8b",
        8,
        8,
        32768,
        ("fp8", True, False),
        "dp=8,tp=1,pp=1,zero=3,microbatch-size=1,recompute=full",
        3890,
        83.9,
        "fit",
    ),
    (
        "T3",
        "FSDP",
        "8b",
        128,
        256,
        8192,
        ("bf16", False, False),
        "dp=128,tp=1,pp=1,zero=3,microbatch-size=2,recompute=selective-op",
        5605,
        67.0,
        "check",
    ),
    (
        "T3",
        "FSDP + compile",
        "8b",
        128,
        256,
        8192,
        ("bf16", True, False),
        "dp=128,tp=1,pp=1,zero=3,microbatch-size=2,recompute=selective-op",
        6514,
        62.0,
        "check",
    ),
    (
        "T3",
        "FSDP + compile + Float8",
        "8b",
        128,
        256,
        8192,
        ("fp8", True, False),
        "dp=128,tp=1,pp=1,zero=3,microbatch-size=2,recompute=selective-op",
        8380,
        61.8,
        "check",
    ),
    (
        "T4",
        "2D",
        "70b",
        256,
        512,
        8192,
        ("fp8", True, False),
        "dp=32,tp=8,pp=1,zero=3,microbatch-size=16,recompute=full,sp=on",
        829,
        71.9,
        "check",
    ),
    (
        "T4",
        "2D + AsyncTP",
        "70b",
        256,
        512,
        8192,
        ("fp8", True, True),
        "dp=32,tp=8,pp=1,zero=3,microbatch-size=16,recompute=full,sp=on",
        876,
        67.6,
        "check",
    ),
    (
        "T5",
        "1F1B",
        "405b",
        512,
        256,
        8192,
        ("fp8", True, True),
        "dp=8,tp=8,pp=8,zero=3,microbatch-size=4,recompute=full,sp=on,schedule=1f1b",
        100,
        82.5,
        "check",
    ),
    (
        "T5",
        "Interleaved 1F1B",
        "405b",
        512,
        256,
        8192,
        ("fp8", True, True),
        "dp=8,tp=8,pp=8,zero=3,microbatch-size=4,recompute=full,sp=on,schedule=interleaved-1f1b,chunks=2",
        128,
        72.7,
        "check",
    ),
    (
        "T6",
        "FSDP 8, CP 1, seq 32768",
        "405b",
        512,
        64,
        32768,
        ("fp8", True, True),
        "dp=8,tp=8,pp=8,zero=3,microbatch-size=1,recompute=full,sp=on,schedule=1f1b",
        76,
        75.3,
        "check",
    ),
]
# Context parallel (torch's context_parallel, its keys and values all-gathered; torchtitan 9dec370's Llama
# repeats them to the query heads before attention, ``repeat_kv`` in torchtitan/models/llama/model.py):
# Table 2's and Table 6's other rows, a local batch of 1 and 8 sequences per FSDP rank, FSDP over dp x cp.
# (table, FSDP, cp, seq, tokens/s per GPU, GiB)
TITAN_CP_ROWS = [
    ("T2", 4, 2, 65536, 2540, 84.2), ("T2", 2, 4, 131072, 1071, 84.0), ("T2", 1, 8, 262144, 548, 84.5),
    ("T6", 4, 2, 65536, 47, 75.9), ("T6", 2, 4, 131072, 31, 77.1), ("T6", 1, 8, 262144, 16, 84.9),
]  # fmt: skip


def titan_cp_row(table: str, fsdp: int, cp: int, seq: int, tokens: int, memory: float) -> tuple:
    """A `TITAN_CP_ROWS` row in `TITAN_ROWS`' form: Table 2's 8B on 8 GPUs (FSDP + CP, compiled, Float8),
    Table 6's 405B on 512 (tp 8, pp 8 with 1F1B, AsyncTP too)."""
    t2 = table == "T2"
    degrees = "tp=1,pp=1" if t2 else "tp=8,pp=8,sp=on,schedule=1f1b"
    fix = f"dp={fsdp},cp={cp},{degrees},zero=3,microbatch-size=1,recompute=full"
    return (table, f"FSDP {fsdp}, CP {cp}, seq {seq}", "8b" if t2 else "405b", 8 if t2 else 512,
            fsdp * (1 if t2 else 8), seq, Software("fp8", True, not t2, repeat_kv=True), fix, tokens, memory,
            "check")  # fmt: skip


TITAN_ROWS += [titan_cp_row(*row) for row in TITAN_CP_ROWS]
# Megatron-LM: (size, heads, hidden, layers, tp, pp, dp, gpus, batch, TFLOP/s per GPU, role)
MEGATRON_ROWS = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, "check"),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, "fit"),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, "check"),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, "check"),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, "check"),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, "check"),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, "check"),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, "fit"),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, "check"),
]  # fmt: skip
MEGATRON_SEQ, MEGATRON_VOCAB = 4096, 131072


def rows() -> list:
    """torchtitan's rows, then Megatron-LM's, as `cluster_check.Row`s."""
    return titan_rows() + megatron_rows()


def titan_rows() -> list:
    """torchtitan's runs; its tensor parallel (torch's ``ColwiseParallel``) keeps the gathered inputs."""
    from benchmarks.cluster_check import CONFIGS, Row
    from pipeclock.cli.plan_cluster import parse_fix

    titan_gpu = load_spec(CONFIGS / "h100-96gb-500w.json")
    result = []
    for table, name, size, gpus, batch, seq, soft, fix, tokens, memory, role in TITAN_ROWS:
        model = paper_model(read_config(CONFIGS / f"llama-3.1-{size}.json"), f"Llama 3.1 {size.upper()}")
        result.append(Row(f"{TITAN} {table}", name, model, Cluster(gpus, titan_gpu), Job(batch, seq),
                          titan_software(soft), parse_fix(fix), tokens, None, memory, role))  # fmt: skip
    return result


def titan_software(soft: Software | tuple) -> Software:
    """A torchtitan row's software: its tensor parallel keeps the gathered inputs, its full recompute
    (torch's non-reentrant checkpoint, compiled) stops at the last tensor the backward reads, its
    pipeline stages are torch's of December 2024 (`pipeclock.plan.stage_buffers`), and its mesh puts pp
    outermost."""
    titan = {"tp_gathered_inputs": True, "recompute_stops_early": True, "pipelining": "torch-2024",
             "rank_order": PP_OUTERMOST}  # fmt: skip
    if isinstance(soft, Software):
        return dataclasses.replace(soft, **titan)
    return Software(*soft, **titan)


def megatron_rows() -> list:
    """Megatron-LM's GPTs, interleaved 1F1B wherever they run a pipeline."""
    from benchmarks.cluster_check import Row
    from pipeclock.cli.plan_cluster import parse_fix

    result, megatron = [], Software("bf16", True, True, rank_order=PP_OUTERMOST)
    for size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, role in MEGATRON_ROWS:
        model = megatron_gpt(size, heads, hidden, layers)
        schedule = ",schedule=interleaved-1f1b" if pp > 1 else ""
        fixed = parse_fix(f"tp={tp},pp={pp},dp={dp}{schedule}")
        result.append(Row(MEGATRON, f"GPT {size}", model, Cluster(gpus, KINDS["H100-80GB"]),
                          Job(batch, MEGATRON_SEQ), megatron, fixed, None, tflops, None,
                          role))  # fmt: skip
    return result


def megatron_gpt(size: str, heads: int, hidden: int, layers: int):
    """Megatron-LM's GPT: GPT-2's shape (learned positions, LayerNorm, GELU, biases), untied embeddings."""
    from transformers import GPT2Config

    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=MEGATRON_VOCAB,
                        n_positions=MEGATRON_SEQ, tie_word_embeddings=False)  # fmt: skip
    return paper_model(config, f"GPT {size}")
