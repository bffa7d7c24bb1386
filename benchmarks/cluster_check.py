"""The cluster planner against runs others published: torchtitan's Llama 3.1 on H100s, Megatron-LM's GPTs.

    python -m benchmarks.cluster_check            # the table of docs/cluster.md, from the package's constants
    python -m benchmarks.cluster_check --fit      # refit the calibration constants on the "fit" rows first
    python -m benchmarks.cluster_check --fit A100_GEMM_EFFICIENCY   # refit only these, the rest kept

Every row is a published run, quoted from its source (file and commit in the modules below), with the
knobs the run fixed (its degrees, batch, sequence, dtype, kernels, recompute...) given to ``plan --fix``;
what the source does not say is left to the search. The calibration constants are fitted on the rows
marked "fit" and only checked on the others.

Sources, each module quoting its own:
- torchtitan's Llama 3.1 and Megatron-LM's GPTs on H100s, both of 2024: `benchmarks.published_2024`.
- The A100 runs of 2021-22 (Megatron-LM's of 2021 and of 2022 with sequence parallel and selective
  recompute, BLOOM, MT-NLG): `benchmarks.published_a100`.
- Meta's Llama 3 405B and NVIDIA's NeMo and Megatron-Bridge runs on H100s: `benchmarks.published_h100`.
- ZeRO-3 without model parallelism (Narayanan et al. 2021, Table 2): `benchmarks.published_zero3`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from benchmarks import cp_bound, published_2024, published_a100, published_h100, published_zero3
from pipeclock.plan import calibration
from pipeclock.plan.cluster_config import PP_OUTERMOST, Job, Software
from pipeclock.plan.cluster_report import figure
from pipeclock.plan.gpus import KINDS, Cluster
from pipeclock.plan.search import search

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "docs" / "cluster"
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30


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
    return published_2024.rows() + a100_rows() + published_h100.rows() + published_zero3.rows(Row)


def a100_rows() -> list[Row]:
    """The published A100 runs (`benchmarks.published_a100`) as rows of the table."""
    from pipeclock.cli.plan_cluster import parse_fix

    result = []
    for run in published_a100.runs():
        software = Software("bf16", fused=True, tp_overlap=False, attention=run.attention,
                            gradients=run.gradients, tp_backward_overlap=run.tp_backward_overlap,
                            deepspeed=run.deepspeed, rank_order=PP_OUTERMOST)  # fmt: skip
        cluster, job = Cluster(run.gpus, KINDS[run.kind]), Job(run.global_batch, run.seq_len)
        model, fixed = published_a100.paper(run), parse_fix(run.fix)
        result.append(Row(run.source, run.name, model, cluster, job, software, fixed, run.tokens_per_gpu,
                          None, run.memory_gib, run.role))  # fmt: skip
    return result


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
            f"| {row.source} | {row.name} | {row.cluster.count} | {figure(published)} {unit} | "
            f"{figure(predicted)} | {speed:+.1%} | {_or_dash(row.memory)} | "
            f"{p['memory']:.1f}{'' if p['fits'] else ' (does not fit)'} | "
            f"{'-' if memory is None else f'{memory:+.1%}'} | {row.role} | {p['config']} |"
        )
    return "\n".join(lines)


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
