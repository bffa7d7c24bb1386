"""Lab 5: from "batch" to "chunks": GPipe, fill then drain.

Lab 4's pipeline was idle (p-1)/p of the time because the whole batch moved as one piece. GPipe cuts
the batch into m micro-batches. Stage 0 sends micro-batch 0 on and starts micro-batch 1 at once, so
soon every stage is working on a different micro-batch (the fill); after the last forward the
backwards run the same way in reverse (the drain). Only the fill and the drain are idle, p - 1 slots
out of m + p - 1, so the bubble is (p-1)/(m+p-1): the larger m, the smaller the bubble. The gradients
do not change: each micro-batch's loss is weighted by its share of the batch, so one step is the
same step as with the whole batch.

This lab trains the same model with the same batch for several m and prints the measured bubble (the
idle share of the ranks' recorded timelines) beside the formula. The measured bubble is a little larger:
real actions also pay for messages and bookkeeping, and the last stage computes the loss as well. Small
micro-batches also use the processor less well and pay those fixed costs more often, so past some m the
step stops getting shorter: watch the step time column.

Run it:  torchrun --nproc-per-node 2 labs/05_gpipe.py        (or: python -m pipeclock lab 5)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from solutions.gpipe import gpipe_step

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.course.beside import compare
from pipeclock.engine.generators import bubble_formula, bubble_formula_text
from pipeclock.observe.machine import timing_context
from pipeclock.observe.metrics import RunReport
from pipeclock.observe.report import draw_runs, measured_ascii
from pipeclock.training.loop import TrainConfig, schedule_table, train

PROCESSES = 2  # how many processes `python -m pipeclock lab 5` asks torchrun for
FORMULA = bubble_formula_text("gpipe")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 5: GPipe's bubble for several numbers of micro-batches")
    parser.add_argument(
        "--microbatches", "-m", type=int, nargs="+", default=[1, 2, 4, 8], help="the values of m to compare"
    )
    parser.add_argument("--draw", type=int, default=4, help="the m whose predicted timeline is drawn")
    parser.add_argument("--hidden", type=int, default=1024, help="width of every layer")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers in the whole model")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="steps per m; the first is not measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/labs"), help="directory for the figures")
    return parser.parse_args(argv)


def config_for(m: int, args: argparse.Namespace) -> TrainConfig:
    return TrainConfig.from_args(args, schedule="gpipe", microbatches=m)


def table_row(m: int, report: RunReport, batch_size: int) -> str:
    formula = bubble_formula("gpipe", len(report.ranks), m)
    return (
        f"{m:>3}  {batch_size / m:>7.4g} samples  {report.step_seconds * 1e3:8.1f} ms  "
        f"{report.bubble_share:14.1%}  {formula:{len(FORMULA) + 8}.1%}"
    )


def draw(reports: dict[int, RunReport], args: argparse.Namespace) -> None:
    """Every m's measured step on one time axis, and one m's predicted timeline above its measured one."""
    p = len(next(iter(reports.values())).ranks)
    runs = [(f"GPipe m={m}", report, schedule_table(config_for(m, args), p)) for m, report in reports.items()]
    path = draw_runs(runs, args.out / "05_gpipe.png", predicted=False)
    print(f"\nthe measured steps for every m drawn to {path}")
    m = args.draw if args.draw in reports else max(reports)
    table = schedule_table(config_for(m, args), p)
    path = draw_runs([(f"GPipe m={m}", reports[m], table)], args.out / f"05_gpipe_m{m}.png")
    print(f"m={m}, predicted and measured, drawn to {path}")
    print(f"\nthe median step with m={m}, as measured (time runs to the right, dots are idle):")
    print(measured_ascii(reports[m]))


def lesson(reports: dict[int, RunReport]) -> None:
    p = len(next(iter(reports.values())).ranks)
    measured = ", ".join(f"{report.bubble_share:.1%} (m={m})" for m, report in reports.items())
    formula = ", ".join(f"{bubble_formula('gpipe', p, m):.1%} (m={m})" for m in reports)
    print("\nlesson: the more micro-batches, the smaller the share of the step lost to fill and drain")
    print(f"  measured bubble          {measured}")
    print(f"  formula {FORMULA:<16} {formula}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    if rank == 0:
        print(
            f"GPipe on {world} stages, one batch of {args.batch_size} cut into m micro-batches, "
            f"ShardedMLP {args.layers} x {args.hidden}, {args.steps} steps per m (the first is warm-up)\n"
        )
        print(f"  m  micro-batch      step time  bubble measured  formula {FORMULA}", flush=True)
    reports: dict[int, RunReport] = {}
    for m in args.microbatches:
        result = train(config_for(m, args))
        if rank == 0:
            reports[m] = result.report
            print(table_row(m, result.report, args.batch_size), flush=True)
    m = args.draw if args.draw in args.microbatches else max(args.microbatches)
    beside = compare(gpipe_step, "gpipe", args.hidden, args.layers, args.batch_size, m, seed=args.seed)
    if rank == 0:
        draw(reports, args)
        print("\n" + "\n".join(beside))
        lesson(reports)
    if rank == 0:
        print(timing_context())
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
