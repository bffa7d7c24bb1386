"""Lab 7: interleaving chunks: a smaller bubble, paid for in messages.

In 1F1B the first micro-batch needs p - 1 stage-times to reach the last rank (the fill), and the last
gradient as long to come back (the drain). Interleaved 1F1B (Megatron-LM's "virtual pipeline") gives
each rank v smaller chunks of the model instead of one big stage: with p = 2 and v = 2, rank 0 holds
layers 0-3 and 8-11, rank 1 layers 4-7 and 12-15, so an activation goes rank 0, 1, 0, 1. The fill now
takes p - 1 chunk-times, and a chunk costs 1/v of a stage, so fill and drain are v times shorter for the
same work: the bubble drops from (p-1)/(m+p-1) to (p-1)/(v*m+p-1).

The price: every micro-batch now crosses between ranks v*p - 1 times instead of p - 1, each way, so
there are more messages per step (counted here from the schedules' action lists, where every action
that needs another rank's output is one message), and a rank holds activations of several chunks at
once, so a little more memory. There are also v times as many actions, each on 1/v of the layers, so
fixed costs per action count v times. Whether the smaller bubble gives a shorter step depends on what
messages and actions cost: compare the step times.

Run it:  torchrun --nproc-per-node 2 labs/07_interleaved.py        (or: python -m pipeclock lab 7)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from solutions.interleaved import interleaved_step

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.course.beside import compare
from pipeclock.engine.generators import bubble_formula, bubble_formula_text
from pipeclock.observe.machine import timing_context
from pipeclock.observe.metrics import RunReport
from pipeclock.observe.report import (
    draw_activations_held,
    draw_runs,
    measured_ascii,
    messages_per_rank,
    side_by_side,
)
from pipeclock.training.loop import TrainConfig, schedule_table, train

PROCESSES = 2  # how many processes `python -m pipeclock lab 7` asks torchrun for
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 7: interleaved 1F1B against 1F1B")
    parser.add_argument("--microbatches", "-m", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--chunks", "-v", type=int, default=2, help="model chunks per rank when interleaving")
    parser.add_argument("--hidden", type=int, default=1024, help="width of every layer")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers in the whole model")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="steps per schedule; the first is not measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/labs"), help="directory for the figures")
    return parser.parse_args(argv)


def configs(args: argparse.Namespace) -> dict[str, TrainConfig]:
    """The two runs, by the name the lab prints."""
    return {
        "1F1B": TrainConfig.from_args(args, schedule="1f1b", chunks=1),
        f"interleaved v={args.chunks}": TrainConfig.from_args(args, schedule="interleaved-1f1b"),
    }


def formula(config: TrainConfig, p: int) -> float:
    return bubble_formula(config.schedule, p, config.microbatches, config.chunks_per_rank())


def comparison(reports: dict[str, RunReport], runs: dict[str, TrainConfig]) -> list[str]:
    """One column per schedule: step time, bubble measured and by formula, messages, peak memory."""
    p = len(next(iter(reports.values())).ranks)
    rows: dict[str, list[str]] = {}
    for name, report in reports.items():
        column = {
            "step time": f"{report.step_seconds * 1e3:.1f} ms",
            "bubble, measured": f"{report.bubble_share:.1%}",
            "bubble, formula": f"{formula(runs[name], p):.1%} = {bubble_formula_text(runs[name].schedule)}",
        }
        for rank, count in enumerate(messages_per_rank(schedule_table(runs[name], p))):
            column[f"messages per step, rank {rank}"] = str(count)
        for rank in range(p):
            column[f"peak activations, rank {rank}"] = f"{report.peak_activation_bytes(rank) / MIB:.2f} MiB"
        for label, value in column.items():
            rows.setdefault(label, []).append(value)
    note = "(messages: sent plus received, one per activation forward or gradient back)"
    return [*side_by_side(list(reports), rows), note]


def draw(reports: dict[str, RunReport], runs: dict[str, TrainConfig], out: Path) -> None:
    p = len(next(iter(reports.values())).ranks)
    timelines = [(name, report, schedule_table(runs[name], p)) for name, report in reports.items()]
    print(f"timelines drawn to {draw_runs(timelines, out / '07_interleaved.png')}")
    path = draw_activations_held(list(reports.items()), out / "07_interleaved_memory.png")
    print(f"micro-batches held over the step drawn to {path}")


def lesson(reports: dict[str, RunReport], runs: dict[str, TrainConfig]) -> None:
    (plain, plain_report), (mixed, mixed_report) = reports.items()
    p = len(plain_report.ranks)
    plain_messages = messages_per_rank(schedule_table(runs[plain], p))
    mixed_messages = messages_per_rank(schedule_table(runs[mixed], p))
    plain_peaks = [plain_report.peak_activation_bytes(rank) / MIB for rank in range(p)]
    mixed_peaks = [mixed_report.peak_activation_bytes(rank) / MIB for rank in range(p)]
    growth = [mixed / plain for mixed, plain in zip(mixed_peaks, plain_peaks, strict=True)]
    plain_formula = f"{bubble_formula_text('1f1b')} = {formula(runs[plain], p):.1%}"
    mixed_formula = f"{bubble_formula_text('interleaved-1f1b')} = {formula(runs[mixed], p):.1%}"
    print("\nlesson: interleaving shrinks the bubble, and pays for it in messages and some memory")
    print(
        f"  measured bubble 1F1B {plain_report.bubble_share:.1%} vs interleaved "
        f"{mixed_report.bubble_share:.1%}; formula {plain_formula} vs {mixed_formula}"
    )
    print(
        f"  messages per step per rank: 1F1B {_listed(plain_messages, '{}')} vs interleaved "
        f"{_listed(mixed_messages, '{}')} ({sum(mixed_messages) / sum(plain_messages):.1f}x)"
    )
    print(
        f"  peak activations per rank: 1F1B {_listed(plain_peaks, '{:.2f}')} MiB vs interleaved "
        f"{_listed(mixed_peaks, '{:.2f}')} MiB ({_listed(growth, '{:.2f}x')})"
    )


def _listed(values: list, form: str) -> str:
    return ", ".join(form.format(value) for value in values)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    runs = configs(args)
    if rank == 0:
        print(
            f"1F1B and interleaved 1F1B on {world} ranks, m = {args.microbatches} micro-batches of "
            f"~{args.batch_size / args.microbatches:g} samples, ShardedMLP {args.layers} x {args.hidden}, "
            f"{args.steps} steps each (the first is warm-up)\n",
            flush=True,
        )
    reports: dict[str, RunReport] = {}
    for name, config in runs.items():
        result = train(config)
        if rank == 0:
            reports[name] = result.report
            print(f"{name}, the median step as measured (dots are idle; F3.1 is micro-batch 3 on chunk 1):")
            print(measured_ascii(result.report) + "\n", flush=True)
    beside = compare(
        interleaved_step,
        "interleaved-1f1b",
        args.hidden,
        args.layers,
        args.batch_size,
        args.microbatches,
        chunks=args.chunks,
        seed=args.seed,
    )
    if rank == 0:
        print("\n".join(comparison(reports, runs)) + "\n")
        draw(reports, runs, args.out)
        print("\n" + "\n".join(beside))
        lesson(reports, runs)
    if rank == 0:
        print(timing_context())
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
