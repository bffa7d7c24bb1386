"""The main job: train a ``ShardedMLP`` with pipeline parallelism, one stage (or chunks) per rank.

Launched under torchrun, every rank runs ``train``; the number of stages is the number of processes.
Rank 0 is the boss: it shows the progress and, at the end, the measurements of the whole run. The
optimizer is per rank (each rank updates only the parameters it holds), which is all pipeline
parallelism needs: no parameter lives on two ranks.

With a checkpoint directory the run saves itself every ``checkpoint_every`` steps and after its last
step (``pipeclock.app.checkpoint``); with ``resume`` it continues from the newest complete checkpoint there,
whatever the number of stages that saved it. Since batch k depends only on (seed, k), a resumed run sees
the data the uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from pipeclock import comms
from pipeclock.app import checkpoint
from pipeclock.app.data import SyntheticRegression
from pipeclock.engine.generators import generate, get_schedule, supports_chunks
from pipeclock.engine.orchestrator import Pipeline, StepRecord
from pipeclock.model import ShardedMLP
from pipeclock.observe.metrics import GpuUtilization, ProcessMeter, RunReport, gather_run


@dataclass
class TrainConfig:
    schedule: str = "1f1b"
    microbatches: int = 8
    chunks: int | None = None  # None: 2 for interleaving schedules, else 1
    # Wide enough that each micro-batch's compute dwarfs the cost of a message, so the measured bubble
    # is the schedule's, yet a run takes about 20 s on 2 CPU cores.
    hidden: int = 1024
    layers: int = 16
    batch_size: int = 128
    steps: int = 60
    lr: float = 1e-3
    seed: int = 0
    timeout: float = 60.0
    measure_memory: bool = True
    checkpoint_dir: str | None = None  # None: no checkpoints
    checkpoint_every: int = 0  # 0: only after the last step
    resume: bool = False  # continue from the newest complete checkpoint in checkpoint_dir

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> TrainConfig:
        """The config a command line asks for: every field ``args`` carries, then ``overrides``.

        A lab's parser has only some of the flags; the fields it lacks keep their defaults.
        """
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **overrides})

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
    first_step: int = 0  # losses[i] is step first_step + i; > 0 when resumed
    resumed_loss: float | None = None  # the checkpoint's last loss, when resumed

    @property
    def final_loss(self) -> float | None:
        """The loss of the run's last step, even when a resumed run had no step left to do."""
        return self.losses[-1] if self.losses else self.resumed_loss


def build_stage(config: TrainConfig, rank: int, world: int) -> list[ShardedMLP]:
    """This rank's chunks of the model, on its device; nothing of the other ranks' layers is allocated."""
    chunks = config.chunks_per_rank()
    parts = ShardedMLP.for_rank(config.hidden, config.layers, rank, world, chunks, config.seed)
    return [part.to(comms.device()) for part in parts]


def train(config: TrainConfig, on_step=None) -> TrainResult:
    """Run the steps up to ``config.steps``; ``on_step(step, loss)`` is called on every rank after each."""
    rank, world = comms.init(timeout=config.timeout)
    _check_checkpointing(config)
    modules = build_stage(config, rank, world)
    pipe = Pipeline(
        modules, config.schedule, config.microbatches, F.mse_loss, measure_memory=config.measure_memory
    )
    optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=config.lr)
    resumed = _resume(config, modules, optimizer)
    start = resumed.step if resumed else 0
    if start >= config.steps:  # resumed from the run's last checkpoint: nothing left to do
        return TrainResult([], [], None, modules, start, resumed.loss)
    data = SyntheticRegression(config.hidden, seed=config.seed)
    meter, gpu = ProcessMeter(), GpuUtilization()
    losses, records = [], []
    for step in range(start, config.steps):
        inputs, targets = data.batch(step, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.step(inputs, targets))
        optimizer.step()
        records.append(pipe.last)
        if on_step:
            on_step(step, losses[-1])
        if _checkpoint_due(config, step + 1):
            _save(config, checkpoint.Position(step + 1, losses[-1], step + 1), modules, optimizer)
    report = gather_run(records, meter, gpu, chunks=len(modules))
    return TrainResult(losses, records, report, modules, start, resumed.loss if resumed else None)


def _check_checkpointing(config: TrainConfig) -> None:
    rank = comms.get_rank()
    if config.checkpoint_every < 0:
        raise ValueError(f"rank {rank}: checkpoint_every must be >= 0, got {config.checkpoint_every}")
    if (config.resume or config.checkpoint_every) and not config.checkpoint_dir:
        raise ValueError(f"rank {rank}: resume and checkpoint_every need a checkpoint_dir")


def _checkpoint_due(config: TrainConfig, steps_done: int) -> bool:
    if not config.checkpoint_dir:
        return False
    every = config.checkpoint_every
    return steps_done == config.steps or (every > 0 and steps_done % every == 0)


def _resume(config: TrainConfig, modules, optimizer) -> checkpoint.Position | None:
    """Load the newest checkpoint when asked to resume; refuse to mix a fresh run with an old one."""
    if not config.checkpoint_dir:
        return None
    rank, directory = comms.get_rank(), config.checkpoint_dir
    found = checkpoint.agreed_newest(directory)
    if found is None:
        if config.resume:
            _say(f"no checkpoint in {directory} to resume from: starting fresh")
        return None
    if not config.resume:
        raise ValueError(
            f"rank {rank}: {directory} already holds checkpoints of a run (newest: {found.name}); "
            "resume it (--resume), or choose another directory"
        )
    saved = checkpoint.read_run(found)
    if (saved["hidden"], saved["layers"]) != (config.hidden, config.layers):
        raise ValueError(
            f"rank {rank}: {found} holds a ShardedMLP {saved['layers']} x {saved['hidden']}, "
            f"not {config.layers} x {config.hidden}"
        )
    position = checkpoint.load(found, modules, optimizer)
    _say(
        f"resumed from {found} at step {position.step} "
        f"(saved by {saved['stages']} stage(s), now {comms.get_world_size()})"
    )
    return position


def _save(config: TrainConfig, position: checkpoint.Position, modules, optimizer) -> None:
    run = {
        "model": "ShardedMLP",
        "hidden": config.hidden,
        "layers": config.layers,
        "seed": config.seed,
        "schedule": config.schedule,
        "chunks": config.chunks_per_rank(),
    }
    path = checkpoint.save(config.checkpoint_dir, position, modules, optimizer, run)
    _say(f"checkpoint saved: {path} (step {position.step})")


def _say(message: str) -> None:
    """Rank 0 speaks for the run."""
    if comms.get_rank() == 0:
        print(message, flush=True)


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
