"""Lab 4: the naive schedule, stop-and-wait.

The simplest way to train a model cut into p stages on p devices: push the whole batch through stage 0,
then stage 1, and so on to the loss, then the backward all the way back, and only then start the next
batch. It is correct, and it is slow: at any moment one device works while the other p - 1 wait for it.
Each rank is busy about 1/p of the time; the pipeline's "bubble", the idle share of all ranks' time, is
(p-1)/p.

This lab measures it three ways: the busy share of each rank from the timeline the ranks record (every
action's start and end, minus the time spent waiting for a message), the CPU the operating system saw
each process use, and on GPUs the utilisation NVML reports, the number nvidia-smi shows (watch it live
with ``nvidia-smi -l 1`` in another terminal while the lab runs). Then it draws the timeline: one box
per moment, never two side by side.

Run it:  torchrun --nproc-per-node 2 labs/04_naive.py        (or: python -m pipeclock lab 4)
Four stages, busy 1/4 each:  python -m pipeclock lab 4 --nproc 4   (two cores are enough here, since
only one rank computes at a time)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from solutions.naive import naive_step

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.course.beside import compare
from pipeclock.engine.generators import bubble_formula, bubble_formula_text
from pipeclock.observe.machine import timing_context
from pipeclock.observe.metrics import RunReport
from pipeclock.observe.report import draw_runs, measured_ascii
from pipeclock.training.loop import TrainConfig, schedule_table, train

PROCESSES = 2  # how many processes `python -m pipeclock lab 4` asks torchrun for


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 4: the naive schedule, stop-and-wait")
    parser.add_argument("--hidden", type=int, default=1024, help="width of every layer")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers in the whole model")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12, help="training steps; the first is not measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/labs"), help="directory for the figure")
    return parser.parse_args(argv)


def utilisation_table(report: RunReport) -> list[str]:
    """Per rank: busy share from the timeline, CPU share from the OS, NVML's GPU share, beside 1/p."""
    p = len(report.ranks)
    gpu = any(run.gpu_utilization is not None for run in report.ranks)
    lines = ["rank   busy (timeline)   CPU (OS)   ideal 1/p" + ("   GPU (NVML)" if gpu else "")]
    for rank, run in enumerate(report.ranks):
        line = f"{rank:>4}   {report.busy_fraction(rank):15.1%}   {run.cpu_percent:7.0f}%   {1 / p:9.1%}"
        if run.gpu_utilization is not None:
            line += f"   {run.gpu_utilization:9.0f}%"
        lines.append(line)
    if not gpu:
        lines.append("(no CUDA here; on GPUs a column shows NVML's utilisation, what nvidia-smi reads)")
    return lines


def teach(report: RunReport, config: TrainConfig, out: Path, beside: list[str]) -> None:
    p = len(report.ranks)
    print("the median step, as measured (time runs to the right, dots are idle):")
    print(measured_ascii(report) + "\n")
    print("\n".join(utilisation_table(report)) + "\n")
    path = draw_runs([("naive", report, schedule_table(config, p))], out / "04_naive.png")
    print(f"timeline drawn to {path}\n")
    print("\n".join(beside) + "\n")

    busy = ", ".join(f"rank {rank} {report.busy_fraction(rank):.1%}" for rank in range(p))
    formula = f"{bubble_formula_text('naive')} = {bubble_formula('naive', p, 1):.1%}"
    print("lesson: stop-and-wait keeps one rank busy at a time")
    print(f"  busy share of the step: {busy}; 1/p = {1 / p:.1%}")
    print(f"  measured bubble {report.bubble_share:.1%} vs formula {formula}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    config = TrainConfig.from_args(args, schedule="naive", microbatches=1)
    if rank == 0:
        print(
            f"naive schedule on {world} stages: the whole batch of {args.batch_size} as one micro-batch, "
            f"ShardedMLP {args.layers} x {args.hidden}, {args.steps} steps (the first is warm-up)\n",
            flush=True,
        )
    result = train(config)
    beside = compare(naive_step, "naive", args.hidden, args.layers, args.batch_size, 1, seed=args.seed)
    if rank == 0:
        teach(result.report, config, args.out, beside)
    if rank == 0:
        print(timing_context())
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
