"""Lab 10: data x pipeline parallel: replicas of a pipeline on a 2D mesh.

One pipeline of p stages keeps p devices busy at best; more devices need a second dimension. The
simplest is to copy the whole pipeline: dp replicas, each taking its own shard of the global batch,
their gradients summed once per step. The processes form a grid, the mesh: a row is one pipeline (its
"pp" group carries activations and gradients between neighbouring stages), a column is the ranks that
hold the same stage in every replica (its "dp" group sums that stage's gradients).

Where does the sum happen? A stage's gradients are complete after its last backward of the step, and
not before: the sum follows it, once per step, whatever the number of micro-batches. FSDP2 (sharded
parameters, gradients and optimizer state) or DDP (full copies) does it; pipeclock only says when.

What does it cost? A pipeline sends activations (a micro-batch's worth of a layer's output, m times
per step); the replicas send gradients (the whole stage's parameters, once per step). The lab counts
both, prints the formula beside them, and checks the first step's loss against one process.

Run it:  torchrun --nproc-per-node 4 labs/10_data_parallel.py        (or: python -m pipeclock lab 10)
"""

from __future__ import annotations

import argparse
import statistics

import psutil
import torch
import torch.nn.functional as F

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.model import ShardedMLP
from pipeclock.observe.machine import timing_context
from pipeclock.observe.metrics import RunReport
from pipeclock.observe.report import typical_step
from pipeclock.training.loop import TrainConfig, train
from pipeclock.training.task_choice import make_task

PROCESSES = 4  # how many processes `python -m pipeclock lab 10` asks torchrun for
MB = 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 10: data x pipeline parallel on a (dp, pp) mesh")
    parser.add_argument("--dp", type=int, default=2, help="replicas of the pipeline (pp = processes / dp)")
    parser.add_argument("--microbatches", "-m", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--hidden", type=int, default=512, help="width of every layer")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers in the whole model")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, over every replica")
    parser.add_argument("--steps", type=int, default=6, help="steps per engine; the first is not measured")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def mesh_picture(dp: int, pp: int) -> list[str]:
    """The grid of ranks: a row is a pipeline ("pp" group), a column a "dp" group."""
    header = "           " + "".join(f"stage {s:<6}" for s in range(pp))
    lines = [header]
    for replica in range(dp):
        ranks = " -- ".join(f"rank {replica * pp + s:<2}" for s in range(pp))
        lines.append(f"replica {replica}  {ranks}")
        if replica + 1 < dp:
            lines.append("           " + "".join(f"{'|':<12}" for _ in range(pp)))
    lines.append('a row is a pipeline: its "pp" group sends activations and gradients along it')
    lines.append('a column holds one stage in every replica: its "dp" group sums that stage\'s gradients')
    return lines


def where_the_sum_happens(report: RunReport, pp: int) -> list[str]:
    """Replica 0's typical step, rank by rank: its actions in order, and the gradient sum among them."""
    step = typical_step(report)
    index = report.timelines.index(step)
    lines = []
    for rank in range(pp):
        record = report.ranks[rank].steps[index]
        events = [(s.start, str(s.action)) for s in record.spans]
        events += [(start, _sum_label(start, end, record.spans)) for start, end in record.syncs]
        lines.append(f"rank {rank}: " + " ".join(text for _, text in sorted(events)))
    return lines


def _sum_label(start: float, end: float, spans) -> str:
    """A gradient sum, and the action it ran during, if any (DDP sums while the backward goes on)."""
    during = next((s for s in spans if s.start <= start < s.end), None)
    inside = f" during {during.action}" if during else ""
    return f"[dp sum {(end - start) * 1e3:.0f} ms{inside}]"


def loopback_bytes() -> int:
    """Bytes sent through this machine's loopback interface so far: gloo's TCP between local ranks."""
    counters = psutil.net_io_counters(pernic=True)
    return counters["lo"].bytes_sent if "lo" in counters else 0


def stage_parameter_bytes(config: TrainConfig, pp: int) -> list[int]:
    """Each stage's parameter bytes: what its dp group sums every step."""
    stages = [ShardedMLP(config.hidden, config.layers, stage, pp) for stage in range(pp)]
    return [sum(p.numel() * p.element_size() for p in stage.parameters()) for stage in stages]


def traffic_lines(report: RunReport, config: TrainConfig, pp: int, loopback: float) -> list[str]:
    """Bytes per step: pipeline messages counted, the gradient sums' formula, and all of it measured."""
    dp, steps = config.dp, range(report.warmup, len(report.timelines))
    counted = statistics.median(sum(run.steps[i].sent_bytes for run in report.ranks) for i in steps)
    per_sample = config.hidden * 4  # a layer's output for one sample, float32
    pp_formula = 2 * (pp - 1) * config.batch_size * per_sample  # activations forward, gradients back
    dp_formula = 2 * (dp - 1) * sum(stage_parameter_bytes(config, pp))  # every rank: 2 (dp-1)/dp of its stage
    return [
        f"pp messages   {counted / MB:6.2f} MB per step counted; formula 2 (pp-1) x batch x hidden x 4 B "
        f"= {pp_formula / MB:.2f} MB",
        f"dp gradients  {dp_formula / MB:6.2f} MB per step by the formula 2 (dp-1) x the model's bytes",
        f"all traffic   {loopback / MB:6.2f} MB per step through the loopback interface; the formulas add up "
        f"to {(pp_formula + dp_formula) / MB:.2f} MB",
    ]


def one_process_loss(config: TrainConfig) -> float:
    """The first step's loss of the whole model on one process, for the whole global batch."""
    inputs, targets = make_task(config).batch(0, config.batch_size)
    model = ShardedMLP(config.hidden, config.layers, stage=0, num_stages=1, seed=config.seed)
    with torch.no_grad():
        return F.mse_loss(model(inputs), targets).item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    if world % args.dp:
        raise SystemExit(f"lab 10: --dp {args.dp} must divide the {world} processes")
    pp = world // args.dp
    boss = rank == 0
    if boss:
        print(f"Lab 10: {args.dp} replicas x {pp} stages on {world} processes\n")
        print("\n".join(mesh_picture(args.dp, pp)) + "\n")
    for engine in ("fsdp", "ddp"):
        config = TrainConfig.from_args(args, data_parallel=engine, schedule="1f1b")
        marks = {}

        def mark(step: int, loss: float, steps: int = config.steps, marks: dict = marks) -> None:
            if step in (0, steps - 1):
                marks[step] = loopback_bytes()

        result = train(config, on_step=mark)
        if not boss:
            continue
        loopback = (marks[config.steps - 1] - marks[0]) / (config.steps - 1)
        report = result.report
        sync_ms = (
            statistics.fmean(s.sync_seconds for run in report.ranks for s in run.steps[report.warmup :]) * 1e3
        )
        step_ms = report.step_seconds * 1e3
        print(
            f"--- {engine}: step {step_ms:.1f} ms, of which summing gradients {sync_ms:.1f} ms "
            f"({sync_ms / step_ms:.0%}, mean over ranks)"
        )
        alone = one_process_loss(config)
        print(f"first-step loss  {result.losses[0]:.6f} (one process, whole batch: {alone:.6f})")
        print("where the sum happens (replica 0, a typical step):")
        print("\n".join("  " + line for line in where_the_sum_happens(report, pp)))
        print("\n".join(traffic_lines(report, config, pp, loopback)) + "\n")
    if rank == 0:
        print(timing_context())
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
