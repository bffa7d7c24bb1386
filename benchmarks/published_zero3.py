"""Published ZeRO-3 runs without model parallelism, as rows of ``benchmarks.cluster_check``'s table.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv 2104.04473), §5.2 and Table 2 ("ZeRO-3 without Model Parallelism"): GPT-3's shape
(174.6B parameters: 96 layers of width 12,288, 96 heads, sequences of 2,048, vocabulary 51,200), a global
batch of 1,536 sequences, on 384, 768 and 1,536 A100-80GB GPUs of Selene (DGX A100 nodes, eight 200 Gb/s
HDR InfiniBand ports each), micro-batches of 4, 2 and 1, DeepSpeed's ZeRO-3, mixed precision, activation
recomputation. Quoted: "Achieved teraFLOP/s per GPU" 144, 88 and 44.

The paper counts a step's FLOPs with its eq. (3), 96·B·s·l·h²·(1 + s/6h + V/16lh): four passes through the
blocks (recompute included) and three through the head. The planner counts model FLOPs (recompute never
counted), so each published rate becomes tokens/s per GPU by the paper's own count per token
(`paper_flops_per_token`), and the rows are compared in tokens/s.
"""

from __future__ import annotations

from pipeclock.plan.cluster_config import PP_OUTERMOST, Job, Software
from pipeclock.plan.gpus import KINDS, Cluster

HEADS, HIDDEN, LAYERS, SEQ, VOCAB, BATCH = 96, 12288, 96, 2048, 51200, 1536
# (GPUs, micro-batch size, achieved teraFLOP/s per GPU as Table 2 gives it)
TABLE_2 = [(384, 4, 144), (768, 2, 88), (1536, 1, 44)]
SOURCE = "Narayanan 2021 Table 2"


def paper_flops_per_token() -> float:
    """Eq. (3) of the paper per token: 96·l·h²·(1 + s/6h + V/16lh)."""
    h, l, s, v = HIDDEN, LAYERS, SEQ, VOCAB  # noqa: E741
    return 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def gpt3_175b():
    """The paper's 174.6B GPT: GPT-2's shape (learned positions, LayerNorm, GELU, biases), tied embeddings."""
    from transformers import GPT2Config

    from pipeclock.plan.hf_paper import paper_model

    config = GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ)
    return paper_model(config, "GPT 174.6B")


def rows(row_type) -> list:
    """The table's rows as ``row_type`` (cluster_check's Row), marked "rule": they are what holds DeepSpeed's
    ZeRO-3 at one NIC a rank (`pipeclock.plan.group_link`), and no constant is fitted on them."""
    from pipeclock.cli.plan_cluster import parse_fix

    model = gpt3_175b()
    result = []
    for gpus, microbatch, tflops in TABLE_2:
        fixed = parse_fix(f"tp=1,pp=1,dp={gpus},zero=3,microbatch-size={microbatch},recompute=full")
        tokens = tflops * 1e12 / paper_flops_per_token()
        name = f"ZeRO-3 174.6B, {tflops} TFLOP/s by its count"
        cluster = Cluster(gpus, KINDS["A100-80GB"])
        software = Software(
            "bf16", fused=True, attention="materialized", deepspeed=True, rank_order=PP_OUTERMOST
        )  # DeepSpeed, 2021
        result.append(row_type(SOURCE, name, model, cluster, Job(BATCH, SEQ), software, fixed, tokens, None,
                               None, "rule"))  # fmt: skip
    return result
