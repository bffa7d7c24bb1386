"""The learning rate of each step: a linear warm-up, then constant, cosine, linear or warmup-stable-decay.

The rate of step s (0-based) of a run of S steps, warm-up W, peak ``lr`` and floor ``min_lr``::

    s < W:     lr * (s + 1) / W
    constant:  lr
    cosine:    min_lr + (lr - min_lr) * (1 + cos(pi * (s - W) / (S - W))) / 2
    linear:    lr + (min_lr - lr) * (s - W) / (S - W)
    wsd:       lr until the last D steps (--decay-steps), then lr + (min_lr - lr) * (s - (S - D)) / D

and min_lr from step S on. It is a pure function of s, so torch's ``LambdaLR`` (which multiplies the
optimizer's own rate by ``rate(s) / lr``) gives each step the same rate however the run was cut into
resumed pieces: a resumed scheduler is built at the checkpoint's position (``scheduler_at``), and the
optimizer holds step s's rate while step s runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("constant", "cosine", "linear", "wsd")


@dataclass(frozen=True)
class LRSchedule:
    """One run's curve: ``rate(s)`` is the learning rate of step s."""

    name: str
    lr: float
    steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: int | None = None  # wsd: the last D steps decay

    @classmethod
    def of(cls, config) -> LRSchedule:
        return cls(
            config.lr_schedule,
            config.lr,
            config.steps,
            config.warmup_steps,
            config.min_lr,
            config.decay_steps,
        )

    def rate(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.name == "constant":
            return self.lr
        if step >= self.steps:
            return self.min_lr
        start, span = self.decay_start(), self.steps - self.decay_start()
        if step < start:
            return self.lr
        progress = (step - start) / span
        if self.name == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2
        return self.lr + (self.min_lr - self.lr) * progress

    def decay_start(self) -> int:
        """The step the decay begins at: after the warm-up, or (wsd) ``decay_steps`` before the end."""
        if self.name == "wsd":
            return self.steps - self.decay_steps
        return self.warmup_steps

    def factor(self, step: int) -> float:
        """``rate(step)`` as a multiple of ``lr``: what ``LambdaLR`` multiplies the rate by."""
        return self.rate(step) / self.lr


def scheduler_at(optimizer: torch.optim.Optimizer, schedule: LRSchedule, step: int) -> LambdaLR:
    """A ``LambdaLR`` on ``schedule`` whose next optimizer step is ``step`` (0: a fresh run; a resumed
    run's steps done): each group's rate set to ``rate(step)``, its ``initial_lr`` to ``schedule.lr``."""
    for group in optimizer.param_groups:
        group["initial_lr"] = schedule.lr
    return LambdaLR(optimizer, schedule.factor, last_epoch=step - 1)


def check_schedule(config) -> None:
    """``ValueError`` naming the flag for a schedule that cannot work with the run's other settings."""
    if config.lr_schedule not in SCHEDULES:
        raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {config.lr_schedule!r}")
    warmup, steps = config.warmup_steps, config.steps
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"--warmup-steps must be a whole number >= 0, got {warmup!r}")
    if warmup > steps:
        raise ValueError(f"--warmup-steps {warmup} is longer than the run (--steps {steps})")
    if not config.min_lr >= 0:
        raise ValueError(f"--min-lr must be >= 0, got {config.min_lr}")
    if config.min_lr > config.lr:
        raise ValueError(f"--min-lr {config.min_lr:g} is above --lr {config.lr:g}: a decay ends below it")
    if config.min_lr > 0 and config.lr_schedule == "constant":
        raise ValueError(
            f"--min-lr {config.min_lr:g} is where a decay ends: use --lr-schedule cosine, linear or wsd"
        )
    _check_decay_steps(config)


def _check_decay_steps(config) -> None:
    decay, steps = config.decay_steps, config.steps
    if config.lr_schedule != "wsd":
        if decay is not None:
            raise ValueError(f"--decay-steps {decay} is for --lr-schedule wsd, not {config.lr_schedule}")
        return
    if decay is None:
        raise ValueError("--lr-schedule wsd needs --decay-steps N (the last N steps decay to --min-lr)")
    if not isinstance(decay, int) or decay < 1:
        raise ValueError(f"--decay-steps must be a whole number >= 1, got {decay!r}")
    if decay > steps:
        raise ValueError(f"--decay-steps {decay} is longer than the run (--steps {steps})")
    if config.warmup_steps + decay > steps:
        raise ValueError(
            f"--warmup-steps {config.warmup_steps} and --decay-steps {decay} overlap in a run of "
            f"--steps {steps}: wsd warms up, holds, then decays"
        )


def resume_line(saved: dict, schedule: LRSchedule, step: int) -> str | None:
    """What a resume at ``step`` that changes ``--steps`` does to the decay, in one line; None when it
    does nothing (the same ``--steps``, or a constant rate). ``saved``: the checkpoint's settings (a
    checkpoint from before the schedules had a constant rate)."""
    old_steps = saved.get("steps")
    if old_steps in (None, schedule.steps) or schedule.name == "constant":
        return None
    old = LRSchedule(
        saved.get("lr_schedule", "constant"),
        saved.get("lr", schedule.lr),
        old_steps,
        saved.get("warmup_steps", 0),
        saved.get("min_lr", 0.0),
        saved.get("decay_steps"),
    )
    now, before = schedule.rate(step), old.rate(step)
    line = (
        f"resume: the {schedule.name} decay now runs from step {schedule.decay_start()} to step "
        f"{schedule.steps} (it ended at step {old_steps}); step {step}'s rate is {now:.4g}"
    )
    return line + (f", not {before:.4g} as on the checkpoint's curve" if before != now else ", as before")
