"""Weak scaling of data x pipeline parallelism: dp = 2 replicas of a 2-stage pipeline against one.

    python -m benchmarks.data_parallel    # starts torchrun; writes benchmarks/results/data_parallel.*

Each replica gets the batch one pipeline gets alone, so ideally dp = 2 x pp = 2 does twice the samples
in the same step time (weak scaling: efficiency = its throughput / (2 x one pipeline's)). Both run the
main job's ``train`` (the MLP, 1F1B, m = 8) for FSDP2 and DDP. On a machine with fewer cores than
processes the 4 processes share the cores, which the results say.

Communication volume per step is measured twice: pipeline messages counted by the engine (every
activation and gradient a rank sends), and everything that crossed the loopback interface (gloo runs
over TCP, so on one machine every byte between ranks goes through it), against the formulas: pipeline
traffic 2 (pp-1) x batch x hidden x 4 B, gradient sums 2 (dp-1) x the model's bytes (each rank sends
2 (dp-1)/dp of its stage's parameters: all-reduce, or reduce-scatter plus all-gather).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import psutil

from benchmarks.launch import ROOT, torchrun

RESULTS = ROOT / "benchmarks" / "results"
HIDDEN, LAYERS, MICROBATCHES = 1024, 16, 8
BATCHES = (64, 256)  # samples per replica per step
MB = 1e6


def _loopback_sent() -> int:
    counters = psutil.net_io_counters(pernic=True)
    return counters["lo"].bytes_sent if "lo" in counters else 0


def worker(dp: int, engine: str, batch: int, steps: int, output: Path) -> None:
    """Train under torchrun; rank 0 writes the run's figures to ``output``."""
    from pipeclock import comms
    from pipeclock.model import ShardedMLP
    from pipeclock.training.loop import TrainConfig, train

    comms.init()
    world = comms.get_world_size()
    pp = world // dp
    config = TrainConfig(
        hidden=HIDDEN, layers=LAYERS, batch_size=batch * dp, microbatches=MICROBATCHES, steps=steps,
        dp=dp, data_parallel=engine if dp > 1 else "fsdp", measure_memory=False,
    )  # fmt: skip
    marks: dict[int, int] = {}

    def mark(step: int, loss: float) -> None:
        if comms.get_rank() == 0 and step in (0, steps - 1):
            marks[step] = _loopback_sent()

    result = train(config, on_step=mark)
    if comms.get_rank() == 0:
        report = result.report
        measured = range(report.warmup, len(report.timelines))
        model_bytes = 4 * sum(p.numel() for p in ShardedMLP(HIDDEN, LAYERS).parameters())
        figures = {
            "dp": dp,
            "pp": pp,
            "engine": engine if dp > 1 else "none",
            "processes": world,
            "batch_per_replica": batch,
            "cores": len(os.sched_getaffinity(0)),
            "step_ms": report.step_seconds * 1e3,
            "samples_per_s": config.batch_size / report.step_seconds,
            "sync_share": statistics.fmean(report.sync_fraction(r) for r in range(world)) if dp > 1 else 0.0,
            "wait_share": statistics.fmean(report.wait_fraction(r) for r in range(world)),
            "pp_bytes_counted": statistics.median(
                sum(run.steps[i].sent_bytes for run in report.ranks) for i in measured
            ),
            "loopback_bytes": (marks[steps - 1] - marks[0]) / (steps - 1),
            "pp_bytes_formula": 2 * (pp - 1) * config.batch_size * HIDDEN * 4,
            "dp_bytes_formula": 2 * (dp - 1) * model_bytes,
        }
        output.write_text(json.dumps(figures))
    comms.shutdown()


RUNS = [(1, 2, "none"), (2, 4, "fsdp"), (2, 4, "ddp")]  # (dp, processes, engine)


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| batch per replica | layout | engine | processes / cores | step | samples/s "
        "| weak-scaling efficiency | dp sum share "
        "| pp messages counted / formula | loopback bytes / formula |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        alone = next(r for r in rows if r["dp"] == 1 and r["batch_per_replica"] == row["batch_per_replica"])
        efficiency = row["samples_per_s"] / (row["dp"] * alone["samples_per_s"])
        formula = row["pp_bytes_formula"] + row["dp_bytes_formula"]
        lines.append(
            f"| {row['batch_per_replica']} | dp {row['dp']} x pp {row['pp']} | {row['engine']} "
            f"| {row['processes']} / {row['cores']} "
            f"| {row['step_ms']:.0f} ms | {row['samples_per_s']:.0f} | {efficiency:.0%} "
            f"| {row['sync_share']:.1%} "
            f"| {row['pp_bytes_counted'] / MB:.2f} / {row['pp_bytes_formula'] / MB:.2f} MB "
            f"| {row['loopback_bytes'] / MB:.1f} / {formula / MB:.1f} MB |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=BATCHES[0], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=12, help="steps per run; the first is not measured")
    parser.add_argument("--out", type=Path, default=RESULTS / "data_parallel", help="results, without suffix")
    args = parser.parse_args()
    if args.worker:
        worker(args.dp, args.engine, args.batch, args.steps, args.out)
        return
    rows = []
    for batch in BATCHES:
        for dp, processes, engine in RUNS:
            part = args.out.with_suffix(f".{batch}.{dp}.{engine}.part.json")
            argv = ["--worker", "--dp", str(dp), "--engine", engine, "--batch", str(batch)]
            argv += ["--steps", str(args.steps), "--out", str(part)]
            torchrun("benchmarks.data_parallel", processes, argv, timeout=900)
            rows.append(json.loads(part.read_text()))
            part.unlink()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    text = "\n".join(table(rows)) + "\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
