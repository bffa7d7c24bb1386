"""T1: the whole model on one process, with gradient accumulation over the same micro-batches.

The ideal pipeline step is ``T1 / p * (m + p - 1) / m``: the one-process work shared by p ranks, plus the
fill-and-drain bubble of GPipe and 1F1B. T1 must be measured with the machine as loaded as during a
pipeline step, or the ideal would be flattered by a core that has the memory bus and the shared cache
to itself. So every rank of a two-process launch runs the full model at the same time, each on its own
core, and the median over ranks and steps is T1. The worker takes these steps in turn with the
pipeline steps of the same (hidden, m), so T1 sees the same machine as the engines it judges.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks import load
from pipeclock import comms
from pipeclock.engine.microbatch import loss_weights, split_microbatches
from pipeclock.model import ShardedMLP
from pipeclock.models.regression import SyntheticRegression


def accumulate(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, m: int) -> None:
    """One step's forward and backward, one micro-batch at a time, each loss weighted by its share."""
    xs, ys = split_microbatches(inputs, m), split_microbatches(targets, m)
    for x, y, weight in zip(xs, ys, loss_weights([len(x) for x in xs]), strict=True):
        (F.mse_loss(model(x), y) * weight).backward()


class OneProcess:
    """The full model on every rank at once; ``step`` times one accumulated step on each."""

    def __init__(self, hidden: int, m: int, layers: int, batch: int):
        self.hidden, self.m, self.batch = hidden, m, batch
        self.model = ShardedMLP(hidden, layers, stage=0, num_stages=1, seed=0)
        self.data = SyntheticRegression(hidden, seed=0)
        self.samples: list[tuple[float, float, float]] = []  # (wall, cpu, machine busy) per step

    def step(self, index: int) -> None:
        inputs, targets = self.data.batch(index, self.batch)
        comms.barrier("starting a one-process step")
        busy, cpu, start = load.busy_seconds(), time.process_time(), time.perf_counter()
        accumulate(self.model, inputs, targets, self.m)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        self.model.zero_grad(set_to_none=True)  # freed at once: only one set of gradients alive at a time
        busy = load.busy_seconds() - busy if busy is not None else float("nan")
        self.samples.append((wall, cpu, busy))

    def result(self) -> dict:
        """T1 over every rank's steps but the first (a warm-up), and over the quiet steps alone."""
        mine = torch.tensor(self.samples[1:], dtype=torch.float64)
        rows = [row.tolist() for row in comms.all_gather(mine, "gathering the one-process times")]
        every = [wall for row in rows for wall, _, _ in row]
        steps = list(zip(*rows, strict=True))  # per step: every rank's (wall, cpu, busy)
        shares = [_foreign_share(step) for step in steps]
        quiet = [
            wall
            for step, share in zip(steps, shares, strict=True)
            if share < load.QUIET
            for wall, _, _ in step
        ]
        return {
            "kind": "baseline",
            "hidden": self.hidden,
            "microbatches": self.m,
            "processes": comms.get_world_size(),
            "step_s": every,
            "foreign_share": shares,
            "t1_s": statistics.median(every),
            "quiet_t1_s": statistics.median(quiet) if quiet else None,
        }


def _foreign_share(step: tuple[list[float], ...]) -> float:
    """Share of the machine other processes used during one step (nan-safe: unknown counts as busy)."""
    wall = max(wall for wall, _, _ in step)
    foreign = step[0][2] - sum(cpu for _, cpu, _ in step)
    return max(0.0, foreign) / (load.cores() * wall) if foreign == foreign else 1.0
