"""Lab 6: 1F1B, the steady state: GPipe's bubble with a fraction of its memory.

A micro-batch's forward leaves activations behind (the tensors autograd saves for the backward), and
they stay until that micro-batch's backward is done. GPipe runs every forward before any backward, so at
its peak each rank holds all m micro-batches: more micro-batches shrink the bubble but not the memory.

1F1B (one forward, one backward) starts the backward of a micro-batch as soon as it can. Rank r runs
only the p - r - 1 forwards it has time for while micro-batch 0 reaches the last stage, then alternates
one forward and one backward (the steady state), then drains the last backwards. Each backward frees
what a forward took, so rank r never holds more than min(m, p - r) micro-batches instead of m. The idle
fill and drain are as long as GPipe's: same bubble, (p-1)/(m+p-1).

This lab runs both schedules on the same model and batch and prints what each rank really held at its
peak (measured by hooks on autograd's saved tensors; it does not depend on timing, so it comes out the
same every run) beside the measured bubbles. It draws two figures: the two timelines, and how many
micro-batches each rank holds over the step.

Run it:  torchrun --nproc-per-node 2 labs/06_1f1b.py        (or: python -m pipeclock lab 6)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from solutions.one_f_one_b import one_f_one_b_step

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.course.beside import compare
from pipeclock.engine.generators import bubble_formula, bubble_formula_text
from pipeclock.observe.machine import timing_context
from pipeclock.observe.metrics import RunReport
from pipeclock.observe.report import draw_activations_held, draw_runs, measured_ascii
from pipeclock.training.loop import TrainConfig, schedule_table, train

PROCESSES = 2  # how many processes `python -m pipeclock lab 6` asks torchrun for
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 6: 1F1B against GPipe, bubble and activation memory")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--hidden", type=int, default=1024, help="width of every layer")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers in the whole model")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="steps per schedule; the first is not measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/labs"), help="directory for the figures")
    return parser.parse_args(argv)


def config_for(schedule: str, args: argparse.Namespace) -> TrainConfig:
    return TrainConfig.from_args(args, schedule=schedule)


def held_in_1f1b(m: int, p: int, rank: int) -> int:
    """The micro-batches rank ``rank`` holds at most in 1F1B (GPipe: all m)."""
    return min(m, p - rank)


def memory_table(reports: dict[str, RunReport], m: int) -> list[str]:
    gpipe, one_f_one_b = reports["gpipe"], reports["1f1b"]
    p = len(gpipe.ranks)
    lines = ["rank   GPipe peak   1F1B peak   GPipe/1F1B   micro-batches held: GPipe m, 1F1B min(m, p-r)"]
    for rank in range(p):
        big, small = gpipe.peak_activation_bytes(rank), one_f_one_b.peak_activation_bytes(rank)
        lines.append(
            f"{rank:>4}   {big / MIB:6.2f} MiB   {small / MIB:5.2f} MiB   {big / small:9.2f}x"
            f"   {m} vs {held_in_1f1b(m, p, rank)}"
        )
    return lines


def draw(reports: dict[str, RunReport], args: argparse.Namespace) -> None:
    p = len(reports["gpipe"].ranks)
    runs = [
        (SCHEDULES[name], report, schedule_table(config_for(name, args), p))
        for name, report in reports.items()
    ]
    print(f"timelines drawn to {draw_runs(runs, args.out / '06_1f1b.png')}")
    held = [(SCHEDULES[name], report) for name, report in reports.items()]
    path = draw_activations_held(held, args.out / "06_1f1b_memory.png")
    print(f"micro-batches held over the step drawn to {path}")


def lesson(reports: dict[str, RunReport], m: int) -> None:
    gpipe, one_f_one_b = reports["gpipe"], reports["1f1b"]
    p = len(gpipe.ranks)
    formula = f"{bubble_formula_text('1f1b')} = {bubble_formula('1f1b', p, m):.1%}"
    print("\nlesson: 1F1B has GPipe's bubble on paper (the formula's) and holds far fewer activations")
    print(
        f"  measured bubble GPipe {gpipe.bubble_share:.1%} vs 1F1B {one_f_one_b.bubble_share:.1%} "
        f"(formula {formula} for both)"
    )
    for rank in range(p):
        big, small = gpipe.peak_activation_bytes(rank), one_f_one_b.peak_activation_bytes(rank)
        print(
            f"  peak activations rank {rank}: GPipe {big / MIB:.2f} MiB vs 1F1B {small / MIB:.2f} MiB, "
            f"{big / small:.2f}x less (m / min(m, p-r) = {m}/{held_in_1f1b(m, p, rank)})"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    if rank == 0:
        print(
            f"GPipe and 1F1B on {world} stages, m = {args.microbatches} micro-batches of "
            f"~{args.batch_size / args.microbatches:g} samples, ShardedMLP {args.layers} x {args.hidden}, "
            f"{args.steps} steps each (the first is warm-up)\n",
            flush=True,
        )
    reports: dict[str, RunReport] = {}
    for name in SCHEDULES:
        result = train(config_for(name, args))
        if rank == 0:
            reports[name] = result.report
            print(f"{SCHEDULES[name]}, the median step as measured (dots are idle):")
            print(measured_ascii(result.report) + "\n", flush=True)
    m = args.microbatches
    beside = compare(one_f_one_b_step, "1f1b", args.hidden, args.layers, args.batch_size, m, seed=args.seed)
    if rank == 0:
        print("\n".join(memory_table(reports, args.microbatches)) + "\n")
        draw(reports, args)
        print("\n" + "\n".join(beside))
        lesson(reports, args.microbatches)
    if rank == 0:
        print(timing_context())
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
