"""Lab 8: zero bubble: split the backward in two and fill the cool-down.

A stage's backward (B) computes two different things. I, the gradient with respect to the stage's
input, is what the previous stage is waiting for. W, the gradients of the stage's own weights, nobody needs
until the optimizer step. 1F1B runs both at once, so in the cool-down the later ranks sit idle while
the gradients travel back to rank 0. ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)
runs I at once and keeps each W for later: rank r postpones r of them into the tail that was idle. With
F = I = W the bubble drops from (p-1)/(m+p-1) to (p-1)/(3m+p-1), and no rank has more micro-batches in
flight than rank 0 already had in 1F1B (p). Memory is still not free: a micro-batch waiting for its W
keeps what W needs, each layer's input and the gradient of its output, which for an MLP is more than
its forward left behind; the lab prints each rank's measured peak.

The arithmetic is not changed, only reordered: after one step from the same weights on the same batch,
every parameter's gradient is the one 1F1B computes, to float rounding. The lab checks that too.

The split costs little time: for a Linear layer, W is one matrix product accumulated into the weight's
gradient, so I + W take about what 1F1B's single B takes (the op times show it). The smaller bubble
becomes a shorter step when the bubble is a large part of the step: few micro-batches per stage.

Run it:  torchrun --nproc-per-node 2 labs/08_zero_bubble.py        (or: python -m pipeclock lab 8)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.engine.generators import bubble_formula, bubble_formula_text
from pipeclock.engine.orchestrator import Pipeline
from pipeclock.model import ShardedMLP
from pipeclock.models.regression import SyntheticRegression
from pipeclock.observe.machine import timing_context
from pipeclock.observe.metrics import RunReport
from pipeclock.observe.report import draw_runs, measured_ascii, measured_costs, side_by_side
from pipeclock.training.loop import TrainConfig, schedule_table, train

PROCESSES = 2  # how many processes `python -m pipeclock lab 8` asks torchrun for
SCHEDULES = {"1f1b": "1F1B", "zb-h1": "ZB-H1"}
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 8: ZB-H1 (split backward) against 1F1B")
    parser.add_argument("--microbatches", "-m", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--hidden", type=int, default=1024, help="width of every layer")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers in the whole model")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="steps per schedule; the first is not measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/labs"), help="directory for the figure")
    return parser.parse_args(argv)


def config_for(schedule: str, args: argparse.Namespace) -> TrainConfig:
    return TrainConfig.from_args(args, schedule=schedule)


def one_step_gradients(schedule: str, args: argparse.Namespace) -> tuple[float, list[torch.Tensor]]:
    """A fresh copy of this rank's stage, one pipeline step on batch 0, and its parameters' gradients."""
    rank, world = comms.get_rank(), comms.get_world_size()
    modules = ShardedMLP.for_rank(args.hidden, args.layers, rank, world, seed=args.seed)
    pipe = Pipeline(modules, schedule, args.microbatches, F.mse_loss)
    inputs, targets = SyntheticRegression(args.hidden, seed=args.seed).batch(0, args.batch_size)
    loss = pipe.step(inputs, targets)
    return loss, [p.grad for module in modules for p in module.parameters()]


def gradient_difference(args: argparse.Namespace) -> tuple[float, float, float, float] | None:
    """On rank 0: the largest |ZB-H1 - 1F1B| over every parameter's gradient on every rank, the
    largest gradient, and the two losses; None on the other ranks."""
    loss_1f1b, grads_1f1b = one_step_gradients("1f1b", args)
    loss_zb, grads_zb = one_step_gradients("zb-h1", args)
    pairs = list(zip(grads_1f1b, grads_zb, strict=True))
    mine = (
        max((a - b).abs().max().item() for a, b in pairs),
        max(a.abs().max().item() for a, _ in pairs),
    )
    gathered = comms.gather_object(mine, "gathering the gradient differences")
    if gathered is None:
        return None
    return max(d for d, _ in gathered), max(g for _, g in gathered), loss_1f1b, loss_zb


def comparison(reports: dict[str, RunReport], m: int) -> list[str]:
    """One column per schedule: step time, bubble measured and by formula, op times, peak memory."""
    p = len(next(iter(reports.values())).ranks)
    rows: dict[str, list[str]] = {}
    for name, report in reports.items():
        costs = measured_costs(report)
        column = {
            "step time": f"{report.step_seconds * 1e3:.1f} ms",
            "bubble, measured": f"{report.bubble_share:.1%}",
            "bubble, formula": f"{bubble_formula(name, p, m):.1%} = {bubble_formula_text(name)}",
            "op times (median)": ", ".join(f"{op} {costs[op] * 1e3:.1f}" for op in "FBIW" if op in costs)
            + " ms",
        }
        for rank in range(p):
            column[f"peak activations, rank {rank}"] = f"{report.peak_activation_bytes(rank) / MIB:.2f} MiB"
        for label, value in column.items():
            rows.setdefault(label, []).append(value)
    return side_by_side([SCHEDULES[name] for name in reports], rows)


def draw(reports: dict[str, RunReport], args: argparse.Namespace) -> None:
    p = len(reports["1f1b"].ranks)
    runs = [
        (SCHEDULES[name], report, schedule_table(config_for(name, args), p))
        for name, report in reports.items()
    ]
    print(f"timelines drawn to {draw_runs(runs, args.out / '08_zero_bubble.png')}")


def lesson(reports: dict[str, RunReport], m: int, gradients: tuple[float, float, float, float]) -> None:
    plain, split = reports["1f1b"], reports["zb-h1"]
    p = len(plain.ranks)
    difference, largest, loss_1f1b, loss_zb = gradients
    plain_formula = f"{bubble_formula_text('1f1b')} = {bubble_formula('1f1b', p, m):.1%}"
    split_formula = f"{bubble_formula_text('zb-h1')} = {bubble_formula('zb-h1', p, m):.1%}"
    print("\nlesson: the deferred weight gradients fill the cool-down, and the gradients stay the same")
    print(
        f"  measured bubble 1F1B {plain.bubble_share:.1%} vs ZB-H1 {split.bubble_share:.1%}; "
        f"formula {plain_formula} vs {split_formula}"
    )
    print(
        f"  gradients after one step on the same batch: max |ZB-H1 - 1F1B| = {difference:.3g} "
        f"(largest gradient {largest:.3g}); losses {loss_1f1b:.6f} and {loss_zb:.6f}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    if rank == 0:
        print(
            f"1F1B and ZB-H1 on {world} stages, m = {args.microbatches} micro-batches of "
            f"~{args.batch_size / args.microbatches:g} samples, ShardedMLP {args.layers} x {args.hidden}, "
            f"{args.steps} steps each (the first is warm-up)\n",
            flush=True,
        )
    reports: dict[str, RunReport] = {}
    for name, title in SCHEDULES.items():
        result = train(config_for(name, args))
        if rank == 0:
            reports[name] = result.report
            print(
                f"{title}, the median step as measured (dots are idle; W3: micro-batch 3's weight gradients):"
            )
            print(measured_ascii(result.report) + "\n", flush=True)
    gradients = gradient_difference(args)
    if rank == 0:
        print("\n".join(comparison(reports, args.microbatches)))
        print("(a B does the work of an I and its W together; ZB-H1's rank 0 runs B's: see the page)\n")
        draw(reports, args)
        lesson(reports, args.microbatches, gradients)
    if rank == 0:
        print(timing_context())
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
