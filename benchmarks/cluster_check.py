"""The cluster planner against runs others published: torchtitan's Llama 3.1 on H100s, Megatron-LM's GPTs.

    python -m benchmarks.cluster_check            # the table of docs/cluster.md, from the package's constants
    python -m benchmarks.cluster_check --fit      # refit the calibration constants on the "fit" rows first
    python -m benchmarks.cluster_check --fit A100_GEMM_EFFICIENCY   # refit only these, the rest kept

Every row is a published run, quoted from its source (file and commit below), with the knobs the run
fixed (its degrees, batch, sequence, dtype, kernels, recompute...) given to ``plan --fix``; what the
source does not say is left to the search. The calibration constants are fitted on the rows marked "fit"
and only checked on the others.

Sources:
- torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` at commit 31a17bfd (pytorch/torchtitan),
  runs of torchtitan 9dec370 (2024-12-26), whose ``train_configs/llama3_*.toml`` give seq_len 8192 and
  whose pipeline default is as many micro-batches as stages; the GPUs are H100s with 96 GB of HBM2e at
  2.4 TB/s and a 500 W power limit (docs/cluster/h100-96gb-500w.json); memory is the peak reserved.
- Megatron-LM, README "Training Speed and Scalability" table (``images/model_table.png``, added in
  commit f2e5db40, 2024-07-15): GPT models, vocabulary 131,072, sequences of 4,096, on H100 SXMs, with
  data-, tensor- and pipeline-parallel communication overlapped; TFLOP/s per GPU as Megatron-LM counts
  them (``num_floating_point_operations``), the count `PaperModel.model_flops_per_token` follows.
- The A100 runs of 2021-22 (Megatron-LM's of 2021 and of 2022 with sequence parallel and selective
  recompute, BLOOM, MT-NLG): `benchmarks.published_a100`, sources there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from benchmarks import cp_bound, published_a100, published_h100, published_zero3
from pipeclock.plan import calibration
from pipeclock.plan.cluster_config import Job, Software
from pipeclock.plan.gpus import KINDS, Cluster, load_spec
from pipeclock.plan.hf_paper import paper_model, read_config
from pipeclock.plan.search import search

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "docs" / "cluster"
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30

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


@dataclasses.dataclass
class Row:
    source: str
    name: str
    model: object
    cluster: Cluster
    job: Job
    software: Software
    fixed: dict
    tokens: float | None  # published tokens/s per GPU
    tflops: float | None  # published TFLOP/s per GPU
    memory: float | None  # published GiB
    role: str
    predicted: dict | None = None


def rows() -> list[Row]:
    from pipeclock.cli.plan_cluster import parse_fix

    result = titan_rows()
    for size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, role in MEGATRON_ROWS:
        model = megatron_gpt(size, heads, hidden, layers)
        schedule = ",schedule=interleaved-1f1b" if pp > 1 else ""
        fixed = parse_fix(f"tp={tp},pp={pp},dp={dp}{schedule}")
        result.append(Row(MEGATRON, f"GPT {size}", model, Cluster(gpus, KINDS["H100-80GB"]),
                          Job(batch, MEGATRON_SEQ), Software("bf16", True, True), fixed, None, tflops, None,
                          role))  # fmt: skip
    return result + a100_rows() + published_h100.rows() + published_zero3.rows(Row)


def titan_rows() -> list[Row]:
    """torchtitan's runs; its tensor parallel (torch's ``ColwiseParallel``) keeps the gathered inputs."""
    from pipeclock.cli.plan_cluster import parse_fix

    titan_gpu = load_spec(CONFIGS / "h100-96gb-500w.json")
    result = []
    for table, name, size, gpus, batch, seq, soft, fix, tokens, memory, role in TITAN_ROWS:
        model = paper_model(read_config(CONFIGS / f"llama-3.1-{size}.json"), f"Llama 3.1 {size.upper()}")
        result.append(Row(f"{TITAN} {table}", name, model, Cluster(gpus, titan_gpu), Job(batch, seq),
                          titan_software(soft), parse_fix(fix), tokens, None, memory, role))  # fmt: skip
    return result


def titan_software(soft: Software | tuple) -> Software:
    """A torchtitan row's software: its tensor parallel keeps the gathered inputs, and its full recompute
    (torch's non-reentrant checkpoint, compiled) stops at the last tensor the backward reads."""
    if isinstance(soft, Software):
        return dataclasses.replace(soft, tp_gathered_inputs=True, recompute_stops_early=True)
    return Software(*soft, tp_gathered_inputs=True, recompute_stops_early=True)


def a100_rows() -> list[Row]:
    """The published A100 runs (`benchmarks.published_a100`) as rows of the table."""
    from pipeclock.cli.plan_cluster import parse_fix

    result = []
    for run in published_a100.runs():
        software = Software("bf16", fused=True, tp_overlap=False, attention=run.attention,
                            gradients=run.gradients, tp_backward_overlap=run.tp_backward_overlap,
                            deepspeed=run.deepspeed)  # fmt: skip
        cluster, job = Cluster(run.gpus, KINDS[run.kind]), Job(run.global_batch, run.seq_len)
        model, fixed = published_a100.paper(run), parse_fix(run.fix)
        result.append(Row(run.source, run.name, model, cluster, job, software, fixed, run.tokens_per_gpu,
                          None, run.memory_gib, run.role))  # fmt: skip
    return result


def megatron_gpt(size: str, heads: int, hidden: int, layers: int):
    """Megatron-LM's GPT: GPT-2's shape (learned positions, LayerNorm, GELU, biases), untied embeddings."""
    from transformers import GPT2Config

    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=MEGATRON_VOCAB,
                        n_positions=MEGATRON_SEQ, tie_word_embeddings=False)  # fmt: skip
    return paper_model(config, f"GPT {size}")


def predict(row: Row, values: dict | None = None) -> dict:
    """The planner's answer for the row's fixed knobs (its best configuration of the rest), with the
    GPU kinds' efficiencies of ``values`` where given."""
    cluster = row.cluster
    if values is not None:
        key = KIND_CONSTANTS.get(cluster.kind.name, "TITAN_GEMM_EFFICIENCY")
        cluster = Cluster(cluster.count, dataclasses.replace(cluster.kind, gemm_efficiency=values[key]))
        if cluster.kind.name == "H100-80GB":  # its fp8 products: their own constant
            kind = dataclasses.replace(cluster.kind, fp8_gemm_efficiency=values[FP8_KEY])
            cluster = Cluster(cluster.count, kind)
    found = search(row.model, cluster, row.job, row.software, row.fixed, top=1)
    best = found.ranked[0] if found.ranked else found.smallest
    return {
        "tokens": best.tokens_per_second_per_gpu,
        "tflops": best.tflops_per_gpu,
        "memory": best.memory.total / GIB,
        "fits": bool(found.ranked),
        "config": best.config.label(),
    }


def errors(row: Row) -> tuple[float | None, float | None]:
    """(speed error, memory error), each (predicted - published) / published."""
    p = row.predicted
    speed = (p["tflops"] / row.tflops - 1) if row.tflops else (p["tokens"] / row.tokens - 1)
    memory = (p["memory"] / row.memory - 1) if row.memory else None
    return speed, memory


# --- fitting ----------------------------------------------------------------------------------------

FITTED = (
    "H100_GEMM_EFFICIENCY",
    "A100_GEMM_EFFICIENCY",
    "H100_FP8_GEMM_EFFICIENCY",
    "TITAN_GEMM_EFFICIENCY",
    "ATTENTION_SHARE",
    "ELEMENTWISE_PASSES_EAGER",
    "ELEMENTWISE_PASSES_FUSED",
    "FP8_SHARE",
    "ALLOCATOR_SLACK",
    "A100_GEMM_HALF_SIZE",
    "H100_GEMM_HALF_SIZE",
    "DEEPSPEED_SHARE",
)
FP8_KEY = "H100_FP8_GEMM_EFFICIENCY"
# The GPU kinds whose products' efficiency is a fitted constant of their own (others: the spec file's).
KIND_CONSTANTS = {
    "H100-80GB": "H100_GEMM_EFFICIENCY",
    "A100-80GB": "A100_GEMM_EFFICIENCY",
    "A100-40GB": "A100_GEMM_EFFICIENCY",
}


def fit(table: list[Row], names: tuple[str, ...] = FITTED) -> dict:
    """Coordinate descent on the squared errors of the "fit" rows, one constant of ``names`` at a time
    (the others keep their values)."""
    values = current()
    chosen = [row for row in table if row.role == "fit"]

    def loss(candidate: dict) -> float:
        apply(candidate)
        total = 0.0
        for row in chosen:
            row.predicted = predict(row, candidate)
            speed, memory = errors(row)
            total += speed**2 + (memory or 0.0) ** 2
        return total

    best = loss(values)
    for _ in range(4):
        for name in names:
            for factor in (0.7, 0.85, 0.93, 0.97, 1.03, 1.07, 1.15, 1.3):
                candidate = dict(values, **{name: values[name] * factor})
                trial = loss(candidate)
                if trial < best:
                    best, values = trial, candidate
    apply(values)
    return values


def current() -> dict:
    return {
        "H100_GEMM_EFFICIENCY": calibration.H100_GEMM_EFFICIENCY,
        "A100_GEMM_EFFICIENCY": calibration.A100_GEMM_EFFICIENCY,
        "TITAN_GEMM_EFFICIENCY": json.loads((CONFIGS / "h100-96gb-500w.json").read_text())["gemm_efficiency"],
        "ATTENTION_SHARE": calibration.ATTENTION_SHARE,
        "ELEMENTWISE_PASSES_EAGER": calibration.ELEMENTWISE_PASSES["eager"],
        "ELEMENTWISE_PASSES_FUSED": calibration.ELEMENTWISE_PASSES["fused"],
        "FP8_SHARE": calibration.FP8_SHARE,
        "ALLOCATOR_SLACK": calibration.ALLOCATOR_SLACK,
        FP8_KEY: calibration.H100_FP8_GEMM_EFFICIENCY,
        "A100_GEMM_HALF_SIZE": calibration.A100_GEMM_HALF_SIZE,
        "H100_GEMM_HALF_SIZE": calibration.H100_GEMM_HALF_SIZE,
        "DEEPSPEED_SHARE": calibration.DEEPSPEED_SHARE,
    }


def apply(values: dict) -> None:
    calibration.ELEMENTWISE_PASSES["eager"] = values["ELEMENTWISE_PASSES_EAGER"]
    calibration.ELEMENTWISE_PASSES["fused"] = values["ELEMENTWISE_PASSES_FUSED"]
    calibration.FP8_SHARE = values["FP8_SHARE"]
    calibration.ATTENTION_SHARE = values["ATTENTION_SHARE"]
    calibration.ALLOCATOR_SLACK = values["ALLOCATOR_SLACK"]
    calibration.A100_GEMM_HALF_SIZE = values["A100_GEMM_HALF_SIZE"]
    calibration.H100_GEMM_HALF_SIZE = values["H100_GEMM_HALF_SIZE"]
    calibration.DEEPSPEED_SHARE = values["DEEPSPEED_SHARE"]


# --- the table -------------------------------------------------------------------------------------


def markdown(table: list[Row]) -> str:
    lines = [
        "| source | run | GPUs | published | predicted | error | published GiB | predicted GiB | error "
        "| role | the planner's configuration |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in table:
        speed, memory = errors(row)
        p = row.predicted
        unit, published, predicted = ("TFLOP/s", row.tflops, p["tflops"]) if row.tflops else (
            "tokens/s", row.tokens, p["tokens"]
        )  # fmt: skip
        lines.append(
            f"| {row.source} | {row.name} | {row.cluster.count} | {_figure(published)} {unit} | "
            f"{_figure(predicted)} | {speed:+.1%} | {_or_dash(row.memory)} | "
            f"{p['memory']:.1f}{'' if p['fits'] else ' (does not fit)'} | "
            f"{'-' if memory is None else f'{memory:+.1%}'} | {row.role} | {p['config']} |"
        )
    return "\n".join(lines)


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.4g}"


def _or_dash(value) -> str:
    return "-" if value is None else f"{value:g}"


def summary(table: list[Row]) -> str:
    """Within the targets on how many rows, and the worst, for the checked rows, the fitted ones, and those
    a rule was read from ("rule": they hold no constant, so a refit does not use them)."""
    lines = []
    label = {"check": "checked rows", "fit": "fitted rows", "rule": "rows a rule was read from"}
    for role in ("check", "fit", "rule"):
        chosen = [row for row in table if row.role == role]
        speed = max(chosen, key=lambda row: abs(errors(row)[0]))
        line = (
            f"{label[role]}: speed within 10 % on {sum(abs(errors(r)[0]) <= 0.10 for r in chosen)} of "
            f"{len(chosen)} (worst {errors(speed)[0]:+.1%}: {speed.source} {speed.name})"
        )
        with_memory = [row for row in chosen if errors(row)[1] is not None]
        if with_memory:
            memory = max(with_memory, key=lambda row: abs(errors(row)[1]))
            line += (
                f"; memory within 10 % on {sum(abs(errors(r)[1]) <= 0.10 for r in with_memory)} of "
                f"{len(with_memory)} (worst {errors(memory)[1]:+.1%}: {memory.source} {memory.name})"
            )
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", nargs="?", const=",".join(FITTED), metavar="NAME,...",
                        help="refit the calibration constants first (all, or the ones named)")  # fmt: skip
    args = parser.parse_args(argv)
    names = tuple(name.strip() for name in (args.fit or "").split(",") if name.strip())
    unknown = [name for name in names if name not in FITTED]
    if unknown:
        parser.error(f"--fit {unknown[0]}: the fitted constants are {', '.join(FITTED)}")
    table = rows()
    started = time.perf_counter()
    values = None
    if names:
        values = fit(table, names)
        print("fitted:", json.dumps(values, indent=2))
    for row in table:
        row.predicted = predict(row, values)
    text = f"{markdown(table)}\n\n{summary(table)}\n\n{cp_bound.report(table, values)}"
    print(text)
    print(f"({time.perf_counter() - started:.0f} s)")
    (RESULTS / "cluster_check.md").write_text(f"# The cluster planner against published runs\n\n{text}\n")
    records = [{"source": r.source, "run": r.name, **r.predicted} for r in table]
    (RESULTS / "cluster_check.json").write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
