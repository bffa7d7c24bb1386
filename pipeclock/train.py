"""The main job: train a ``ShardedMLP`` with pipeline parallelism, one stage (or chunks) per rank.

Launched under torchrun, every rank runs ``train``; the number of stages is the number of processes.
Rank 0 is the boss: it shows the progress and, at the end, the measurements of the whole run. The
optimizer is per rank (each rank updates only the parameters it holds), which is all pipeline
parallelism needs: no parameter lives on two ranks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pipeclock import comms
from pipeclock.data import SyntheticRegression
from pipeclock.generators import generate, get_schedule, supports_chunks
from pipeclock.metrics import GpuUtilization, ProcessMeter, RunReport, gather_run
from pipeclock.model import ShardedMLP
from pipeclock.orchestrator import Pipeline, StepRecord


@dataclass
class TrainConfig:
    schedule: str = "1f1b"
    microbatches: int = 8
    chunks: int | None = None  # None: 2 for interleaving schedules, else 1
    hidden: int = 256
    layers: int = 16
    batch_size: int = 64
    steps: int = 100
    lr: float = 1e-3
    seed: int = 0
    timeout: float = 60.0
    measure_memory: bool = True

    def chunks_per_rank(self) -> int:
        if self.chunks is not None:
            return self.chunks
        return 2 if supports_chunks(get_schedule(self.schedule)) else 1


@dataclass
class TrainResult:
    losses: list[float]
    records: list[StepRecord]
    report: RunReport | None  # on rank 0
    modules: list[torch.nn.Module] = field(repr=False, default_factory=list)


def build_stage(config: TrainConfig, rank: int, world: int) -> list[ShardedMLP]:
    """This rank's chunks of the model; nothing of the other ranks' layers is allocated."""
    return ShardedMLP.for_rank(
        config.hidden, config.layers, rank, world, config.chunks_per_rank(), config.seed
    )


def train(config: TrainConfig, on_step=None) -> TrainResult:
    """Run ``config.steps`` optimizer steps; ``on_step(step, loss)`` is called on every rank after each."""
    rank, world = comms.init(timeout=config.timeout)
    modules = build_stage(config, rank, world)
    pipe = Pipeline(
        modules, config.schedule, config.microbatches, F.mse_loss, measure_memory=config.measure_memory
    )
    optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=config.lr)
    data = SyntheticRegression(config.hidden, seed=config.seed)
    meter, gpu = ProcessMeter(), GpuUtilization()
    losses, records = [], []
    for step in range(config.steps):
        inputs, targets = data.batch(step, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.step(inputs, targets))
        optimizer.step()
        records.append(pipe.last)
        if on_step:
            on_step(step, losses[-1])
    report = gather_run(records, meter, gpu, chunks=len(modules))
    return TrainResult(losses, records, report, modules)


def schedule_table(config: TrainConfig, world: int):
    """The whole pipeline's action lists (for the predicted timeline)."""
    return generate(config.schedule, world, config.microbatches, config.chunks_per_rank())


class Progress:
    """Rank 0's progress: a bar on a terminal, a line every tenth of the run otherwise."""

    def __init__(self, steps: int, enabled: bool):
        self.steps, self.enabled = steps, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True)

    def __call__(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update()
        elif step % max(1, self.steps // 10) == 0 or step == self.steps - 1:
            print(f"step {step:5d}  loss {loss:.6f}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
