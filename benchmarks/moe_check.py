"""The cluster planner against a published mixture-of-experts run: DeepSeek-V3's pre-training.

    python -m benchmarks.moe_check        # the rows of docs/cluster.md's mixture-of-experts table

Source: DeepSeek-V3 Technical Report (arXiv 2412.19437v2), §1 and Table 1: pre-training took 2,664K H800
GPU-hours for 14.8T tokens, "180K H800 GPU hours" per trillion tokens, on 2,048 H800s (§3.1: 8 GPUs a node
on NVLink and NVSwitch, InfiniBand between nodes); §3.2: 16-way pipeline parallel (DualPipe), 64-way expert
parallel over 8 nodes, ZeRO-1 data parallel, no tensor parallel; §3.3: fp8 products, the tokens sent to
the experts in fp8 and combined in bf16; §4.2: sequences of 4,096 tokens, 15,360 a step (after the first
469B tokens' ramp). The model is its Hugging Face config (docs/cluster/deepseek-v3.json, transformers'
DeepseekV3Config defaults: 61 layers, MLA, 256 routed experts and one shared, top 8 of at most 4
groups); the GPU docs/cluster/h800.json. The micro-batch size and recompute are left to the search (the
report recomputes the norms and MLA's up-projections: lighter than "selective-op").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeclock.plan.cluster_config import PP_OUTERMOST, Job, Software
from pipeclock.plan.gpus import Cluster, load_spec
from pipeclock.plan.hf_paper import paper_model, read_config
from pipeclock.plan.search import search

CONFIGS = Path(__file__).resolve().parent.parent / "docs" / "cluster"
GPU_HOURS_PER_TRILLION = 180e3
PUBLISHED_TOKENS_PER_GPU = 1e12 / (GPU_HOURS_PER_TRILLION * 3600)  # 1,543 tokens/s per GPU


@dataclass(frozen=True)
class MoeRow:
    name: str
    fix: str
    published: float | None  # tokens/s per GPU


ROWS = (
    MoeRow("DeepSeek-V3 pre-training (DualPipe)", "tp=1,pp=16,dp=128,ep=64,zero=1,schedule=dualpipev",
           PUBLISHED_TOKENS_PER_GPU),
    MoeRow("the same with 1F1B (not run)", "tp=1,pp=16,dp=128,ep=64,zero=1,schedule=1f1b", None),
    MoeRow("the same without ep (not run)", "tp=1,pp=16,dp=128,ep=1,zero=1,schedule=dualpipev", None),
)  # fmt: skip


def predict(row: MoeRow):
    """The planner's best configuration for the row's fixed knobs (or the leanest, if none fits)."""
    from pipeclock.cli.plan_cluster import parse_fix

    model = paper_model(read_config(CONFIGS / "deepseek-v3.json"), "DeepSeek-V3")
    cluster = Cluster(2048, load_spec(CONFIGS / "h800.json"))
    software = Software("fp8", True, False, rank_order=PP_OUTERMOST)  # the frameworks' order, as published
    found = search(model, cluster, Job(15360, 4096), software, parse_fix(row.fix), top=1)
    return found.ranked[0] if found.ranked else found.smallest


def markdown() -> str:
    lines = [
        "| run | published tokens/s/GPU | predicted | error | predicted GiB | all-to-all s (hidden or not) | "
        "step s | the planner's configuration |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in ROWS:
        p = predict(row)
        error = "-" if row.published is None else f"{p.tokens_per_second_per_gpu / row.published - 1:+.1%}"
        published = "-" if row.published is None else f"{row.published:,.0f}"
        memory = f"{p.memory.total / 2**30:.1f}" + ("" if p.fits else " (does not fit)")
        lines.append(
            f"| {row.name} | {published} | {p.tokens_per_second_per_gpu:,.0f} | {error} | {memory} | "
            f"{p.time.ep:.2f} | {p.time.step:.2f} | {p.config.label()} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
