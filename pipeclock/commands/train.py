"""``torchrun --nproc-per-node N -m pipeclock train [...]``: the main job.

The number of stages is the number of processes torchrun starts. Rank 0 prints the progress, then the
run's measurements, and the last line is ``final loss <value> after <N> steps``.
"""

from __future__ import annotations

import argparse
import sys

from pipeclock import comms
from pipeclock.generators import SCHEDULES
from pipeclock.report import draw_timelines, summary_lines, write_trace
from pipeclock.train import Progress, TrainConfig, schedule_table, train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainConfig()
    parser.add_argument("--schedule", default=defaults.schedule, choices=list(SCHEDULES))
    parser.add_argument(
        "--microbatches", type=int, default=defaults.microbatches, help="micro-batches per step"
    )
    parser.add_argument(
        "--chunks", type=int, default=None, help="model chunks per rank (default: 2 if interleaved)"
    )
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="width of every layer")
    parser.add_argument(
        "--layers", type=int, default=defaults.layers, help="Linear layers in the whole model"
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout, help="seconds any blocking call may wait"
    )
    parser.add_argument("--trace", metavar="FILE", help="write the run's timeline as a Chrome trace (JSON)")
    parser.add_argument("--png", metavar="FILE", help="draw the predicted and measured timelines")


def config_from(args: argparse.Namespace) -> TrainConfig:
    fields = (
        "schedule",
        "microbatches",
        "chunks",
        "hidden",
        "layers",
        "batch_size",
        "steps",
        "lr",
        "seed",
        "timeout",
    )
    return TrainConfig(**{name: getattr(args, name) for name in fields})


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    try:
        return _train_and_report(config, args)
    except (ValueError, comms.CommError) as error:
        print(f"pipeclock train: error: {error}", file=sys.stderr, flush=True)
        return 2 if isinstance(error, ValueError) else 1
    finally:
        comms.shutdown()


def _train_and_report(config: TrainConfig, args: argparse.Namespace) -> int:
    rank, world = comms.init(timeout=config.timeout)
    boss = rank == 0
    if boss:
        print(_headline(config, world), flush=True)
    progress = Progress(config.steps, enabled=boss)
    result = train(config, on_step=progress)
    progress.close()
    if not boss:
        return 0
    table = schedule_table(config, world)
    print("\n" + "\n".join(summary_lines(result.report, config.schedule, table, config.batch_size)))
    if args.trace:
        path = write_trace(result.report, args.trace)
        print(f"\ntrace written to {path} (open it in chrome://tracing or https://ui.perfetto.dev)")
    if args.png:
        path = draw_timelines(result.report, table, args.png, config.schedule)
        print(f"timelines drawn to {path}")
    print(f"final loss {result.losses[-1]:.6f} after {config.steps} steps", flush=True)
    return 0


def _headline(config: TrainConfig, world: int) -> str:
    chunks = config.chunks_per_rank()
    per_mb = config.batch_size / config.microbatches
    return (
        f"pipeclock train: {config.schedule}, {world} stage(s) x {chunks} chunk(s), {config.microbatches} "
        f"micro-batches of ~{per_mb:g} samples, ShardedMLP {config.layers} x {config.hidden}, "
        f"{config.steps} steps"
    )
