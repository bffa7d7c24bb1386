"""A run's checkpoints: the flags checked, when one is due, resuming from one and saving one."""

from __future__ import annotations

from pipeclock import comms
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.checkpoints import resume
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.training.config import TrainConfig
from pipeclock.training.lr_schedule import LRSchedule, resume_line
from pipeclock.training.optimizer import group_settings, restore_settings

CHECKPOINT_FLAGS = {
    "--resume": "resume",
    "--checkpoint-every": "checkpoint_every",
    "--keep-last": "keep_last",
}


def check_checkpointing(config: TrainConfig) -> None:
    """Refuse, before any rank waits, counts below zero and checkpoint flags without a folder."""
    rank = comms.get_rank()
    if config.checkpoint_every < 0:
        raise ValueError(f"rank {rank}: --checkpoint-every must be >= 0, got {config.checkpoint_every}")
    if config.keep_last < 0:
        raise ValueError(
            f"rank {rank}: --keep-last must be >= 0 (0 keeps every checkpoint), got {config.keep_last}"
        )
    given = [flag for flag, value in CHECKPOINT_FLAGS.items() if getattr(config, value)]
    if given and not config.checkpoint_dir:
        needs = "needs" if len(given) == 1 else "need"
        raise ValueError(
            f"rank {rank}: {' and '.join(given)} {needs} --checkpoint-dir (where the checkpoints go)"
        )


def checkpoint_due(config: TrainConfig, steps_done: int) -> bool:
    """A checkpoint after every ``checkpoint_every`` steps and after the last one."""
    if not config.checkpoint_dir:
        return False
    every = config.checkpoint_every
    return steps_done == config.steps or (every > 0 and steps_done % every == 0)


def resume_run(config: TrainConfig, task, modules, optimizer) -> tuple[checkpoint.Position | None, int]:
    """Load the checkpoint ``--resume`` means; refuse to mix a fresh run with an old one. Returns where
    it stopped (None: a fresh run) and the learning-rate schedule's position there (0 when fresh).

    The model must be the checkpoint's; the flags' training settings win (the optimizer's hyperparameters
    among them, over those its loaded state brings back), and each change is reported
    (``pipeclock.checkpoints.resume``).
    """
    fresh = None, 0
    if not config.checkpoint_dir:
        return fresh
    if not config.resume:
        found = checkpoint.agreed_newest(config.checkpoint_dir)
        if found is not None:
            raise ValueError(
                f"rank {comms.get_rank()}: {config.checkpoint_dir} already holds checkpoints of a run "
                f"(newest: {found.name}); resume it (--resume), or choose another directory"
            )
        return fresh
    choice = resume.choose(config)
    if choice.path is None:
        _say(f"no checkpoint in {config.checkpoint_dir} to resume from: starting fresh")
        return fresh
    for line in choice.skipped_lines():
        _say(line)
    found, saved = choice.path, checkpoint_choice.read_run(choice.path)
    resume.check_same_model(found, saved, task.run_info())
    resume.check_no_newer(config, found)
    settings = group_settings(optimizer)
    position = checkpoint.load(found, modules, optimizer)
    restore_settings(optimizer, settings)
    scheduled = resume.scheduler_step(saved, position.step)
    before = _layout(saved["stages"], saved.get("replicas", 1), saved.get("tp", 1), saved.get("ep", 1))
    now = _layout(stages_of(config), config.dp, config.tp, config.ep).removesuffix(" stage(s)")
    _say(f"resumed from {found} at step {position.step} (saved by {before}, now {now})")
    changed = resume.changes(saved, config)
    if changed:
        _say("resume: " + "; ".join(changed))
    decay = resume_line(saved.get("settings", {}), LRSchedule.of(config), scheduled)
    if decay:
        _say(decay)
    return position, scheduled


def _layout(stages: int, replicas: int, tp: int = 1, ep: int = 1) -> str:
    return (
        f"{stages} stage(s)"
        + (f" x tp {tp}" if tp > 1 else "")
        + (f" x {replicas} replicas" if replicas > 1 else "")
        + (f", experts over ep {ep}" if ep > 1 else "")
    )


def stages_of(config: TrainConfig) -> int:
    """The pipeline's stages: the processes left once dp and tp have taken theirs."""
    return comms.get_world_size() // (config.dp * config.tp)


def save_run(config: TrainConfig, task, position: checkpoint.Position, modules, optimizer, scheduler) -> None:
    """Save this step with what a resume checks (model, layout, settings); prune to ``keep_last``."""
    run = {
        **task.run_info(),
        "schedule": config.schedule,
        "chunks": config.chunks_per_rank(),
        "stages": stages_of(config),
        "replicas": config.dp,
        "tp": config.tp,
        "ep": config.ep,
        "settings": resume.settings_of(config),
        "lr_scheduler": resume.scheduler_state(scheduler),
    }
    path = checkpoint.save(config.checkpoint_dir, position, modules, optimizer, run)
    _say(f"checkpoint saved: {path} (step {position.step})")
    if config.keep_last and comms.get_rank() == 0:
        removed = checkpoint_choice.prune(config.checkpoint_dir, config.keep_last, path)
        if removed:
            names = ", ".join(sorted(p.name for p in removed))
            _say(f"--keep-last {config.keep_last}: removed {names}")


def _say(message: str) -> None:
    """Rank 0 speaks for the run."""
    if comms.get_rank() == 0:
        print(message, flush=True)
