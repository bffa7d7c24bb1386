"""Resuming a run: which checkpoint it continues, and what it takes from there rather than from its flags.

Which checkpoint (``checkpoint_choice.choose``, every rank together):

- ``--resume`` alone: the newest sound checkpoint in ``--checkpoint-dir`` (none yet: a fresh start);
- ``--resume DIR``: the newest sound checkpoint of the run in DIR;
- ``--resume DIR/step_000010``: that checkpoint, or one error naming its damaged file.

A run directory's newer damaged checkpoints are skipped, one line each. Resuming from elsewhere into a
``--checkpoint-dir`` that already holds a newer sound checkpoint is refused: the two runs' saves would
interleave, and the next ``--resume`` would pick the other run's.

What wins:

- The model comes from the checkpoint: its kind, its size and its seed (which fixed the initial weights
  and fixes every batch) must be what the flags ask for, or the run stops with one error saying which.
- The state comes from the checkpoint: weights, Adam's moments, the step, the data position, the RNGs,
  and the learning-rate scheduler's position (``lr_scheduler`` in its ``pipeclock.json``).
- The training settings come from the command line, defaults included (``SETTINGS``): the flags describe
  the run from here on. Each one that differs from the saving run's is printed once,
  ``resume: --lr 0.01 (checkpoint had 0.001)``. The optimizer's hyperparameters (rate, betas, eps, weight
  decay) are set again after the load, since the optimizer state DCP restores carries the old ones; a
  new ``--steps`` moves the end of the decay, and the run says so in one line
  (``training.lr_schedule.resume_line``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeclock import comms
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.models.registry import describe, differences, same_model

# The training settings a checkpoint records and a resumed run may change. The stage and replica counts
# are reported on their own line; how often to save or validate is no part of the training. ``chunks`` is
# recorded as resolved (the schedule's default filled in).
SETTINGS = (
    "lr",
    "optimizer",
    "weight_decay",
    "betas",
    "eps",
    "lr_schedule",
    "warmup_steps",
    "min_lr",
    "decay_steps",
    "steps",
    "batch_size",
    "microbatches",
    "schedule",
    "chunks",
    "dtype",
    "recompute",
    "clip_grad_norm",
    "balance",
    "data_parallel",
    "data",
    "dropout",
)


def settings_of(config) -> dict:
    """The values of ``SETTINGS`` a run uses, as a checkpoint records them."""
    found = {
        name: config.chunks_per_rank() if name == "chunks" else getattr(config, name) for name in SETTINGS
    }
    return {**found, "betas": list(config.betas)}  # as JSON gives it back


def target(config) -> Path:
    """What ``--resume`` points at: its own path, or ``--checkpoint-dir`` when given alone."""
    return Path(config.checkpoint_dir if config.resume is True else config.resume)


class ResumeRefused(checkpoint_choice.CheckpointError, ValueError):
    """What ``--resume`` names cannot be resumed from (not there, unfinished, damaged): refused before the
    first step, as a value that cannot work is (exit code 2; a save or a load that fails is 1)."""


def choose(config) -> checkpoint_choice.Choice:
    """The checkpoint to resume from, the same on every rank; a named path that is not there is an error."""
    where = target(config)
    try:
        choice = checkpoint_choice.choose(where)
    except checkpoint_choice.CheckpointError as error:
        raise ResumeRefused(f"rank {comms.get_rank()}: {error}") from None
    if choice.path is None and config.resume is not True:
        error = checkpoint_choice.none_in(where)
        raise ResumeRefused(f"rank {comms.get_rank()}: {error}")
    return choice


def check_same_model(found: Path, saved: dict, wanted: dict) -> None:
    """``ValueError`` unless the checkpoint holds the model (kind, size, seed) the flags ask for."""
    rank = comms.get_rank()
    if _seed(saved) is not None and _seed(saved) != _seed(wanted):
        raise ValueError(
            f"rank {rank}: {found} was trained with --seed {_seed(saved)}, not --seed {_seed(wanted)} "
            "(the seed fixes the initial weights and every batch: resume with the checkpoint's)"
        )
    if not same_model(saved, wanted):
        saved_model, wanted_model = describe(saved), describe(wanted)
        if saved_model.split()[0] == wanted_model.split()[0]:  # same kind: say only the sizes
            wanted_model = wanted_model.split(" ", 1)[1]
        fields = "; ".join(differences(saved, wanted))
        if "vocab_size" in fields:
            fields += " (the vocabulary is --data's: resume on the tokens the run was trained on)"
        if wanted_model in saved_model:  # the sizes agree: only what the fields name differs
            raise ValueError(f"rank {rank}: {found} holds a {saved_model} of other settings: {fields}")
        raise ValueError(
            f"rank {rank}: {found} holds a {saved_model}, not {wanted_model}"
            + (f" ({fields})" if fields else "")
        )


def check_no_newer(config, found: Path) -> None:
    """``ValueError`` when resuming from elsewhere into a ``--checkpoint-dir`` with a newer checkpoint."""
    directory = Path(config.checkpoint_dir)
    if target(config).resolve() == directory.resolve():
        return  # the directory's own newest sound checkpoint: nothing newer is sound
    newer = None
    if comms.get_rank() == 0:
        sound = checkpoint_choice.sound_checkpoints(directory)
        step = checkpoint_choice.step_of(found)
        newer = next((p.name for p in sound if checkpoint_choice.step_of(p) > step), None)
    newer = comms.all_gather_object(newer, f"looking for checkpoints newer than {found}")[0]
    if newer:
        raise ValueError(
            f"rank {comms.get_rank()}: --checkpoint-dir {directory} already holds {newer}, newer than "
            f"the checkpoint resumed from ({found}): the saves of two runs would mix there; choose "
            "another --checkpoint-dir, or move the newer checkpoints away"
        )


def changes(saved: dict, config) -> list[str]:
    """``--lr 0.01 (checkpoint had 0.001)`` for each recorded setting this run changes."""
    recorded, now = saved.get("settings", {}), settings_of(config)
    return [
        f"--{name.replace('_', '-')} {_shown(now[name])} (checkpoint had {_shown(recorded[name])})"
        for name in SETTINGS
        if name in recorded and recorded[name] != now[name]
    ]


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
    """What a checkpoint records of the learning-rate scheduler: its position (the steps it has counted)
    and the rates it set for the next step. The curve itself is the settings' (a pure function)."""
    state = scheduler.state_dict()
    return {"last_epoch": state["last_epoch"], "last_lr": [float(lr) for lr in state["_last_lr"]]}


def scheduler_step(saved: dict, step: int) -> int:
    """The scheduler's position a checkpoint recorded; ``step`` for one saved before it recorded any
    (its rate was constant, so its position was its step count)."""
    return saved.get("lr_scheduler", {}).get("last_epoch", step)


def _seed(run: dict) -> int | None:
    return run["gpt"].get("seed") if "gpt" in run else run.get("seed")


def _shown(value) -> str:
    if isinstance(value, list | tuple):  # --betas 0.9,0.95
        return ",".join(f"{item:g}" for item in value)
    return "none" if value is None else str(value)
