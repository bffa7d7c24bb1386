"""A run's figures where a team watches them: ``metrics.jsonl``, TensorBoard and Weights & Biases.

The loop hands ``RunLog.log(step, figures)`` what it measured of each step: ``loss``, ``lr``,
``grad_norm`` when it has one, ``step_seconds``, ``step_tokens`` and, after a validation, ``val_loss``.
The log adds what follows from them: ``tokens`` so far, ``tokens_per_second`` and ``step_seconds`` over
the steps since the last record (the steps' own time: validations and checkpoints left out), on a GPU
``tflops_per_gpu`` and ``mfu`` (the planner's paper model's FLOPs per token, the GPU table's peak), and
this process's memory (``rss_mib``; ``cuda_peak_mib`` on a GPU). A record is written every ``every``
steps, after the last one and with each validation loss. Rank 0 alone keeps a log: the loss is the same
on every rank.

``step`` counts the steps done (1 after the first), as checkpoints and validation do. A resumed run
starting after step s first drops the records of steps after s (it does them again): from
``metrics.jsonl``, and from TensorBoard with its own ``purge_step``.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import psutil
import torch

METRICS_NAME = "metrics.jsonl"
MIB = 2**20


def check_available(log_dir: str | None, wandb: str | None) -> None:
    """``ValueError`` in one line when a log the run asks for needs a package that is not installed."""
    if log_dir and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            f"--log-dir {log_dir}: TensorBoard's event files need the tensorboard package, which is not "
            "installed: pip install tensorboard (or pipeclock's train extra)"
        )
    if wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            f"--wandb {wandb}: the wandb package is not installed: pip install wandb "
            "(WANDB_MODE=offline then logs with no network)"
        )


def check_fresh(log_dir: str | None, resume: bool | str) -> None:
    """``ValueError`` when a fresh run (no ``--resume``) would mix its records with another run's."""
    if log_dir and not resume and (Path(log_dir) / METRICS_NAME).exists():
        raise ValueError(
            f"--log-dir {log_dir} already holds a run's {METRICS_NAME}; resume that run (--resume), or "
            "choose another folder"
        )


class RunLog:
    """Records of a run's figures, written to every log it was given."""

    def __init__(
        self,
        log_dir: str | None,
        every: int,
        last_step: int,
        start: int = 0,
        wandb_project: str | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        processes: int = 1,
        config: dict | None = None,
    ) -> None:
        """``last_step``: the run's step count; ``start``: the steps done before this run (resumed);
        ``flops_per_token``, ``peak_flops``: model FLOPs of a token's training, one device's peak
        (None off a GPU: no TFLOP/s, no MFU); ``processes``: the devices the run's tokens share."""
        self.every, self.last_step, self.start = max(1, every), last_step, start
        self.flops_per_token, self.peak_flops, self.processes = flops_per_token, peak_flops, processes
        self.writers: list = []
        if log_dir:
            self.writers += [JsonLines(log_dir, start), TensorBoard(log_dir, start)]
        if wandb_project:
            self.writers.append(WeightsAndBiases(wandb_project, log_dir, config or {}))
        self.tokens: int | None = None
        self._seconds, self._tokens = 0.0, 0
        self._steps = 0

    def log(self, step: int, figures: dict[str, float | None]) -> dict | None:
        """Count step ``step`` (steps done)'s figures; write a record when one is due; the record."""
        if self.tokens is None:  # the steps before a resume, at this run's batch
            self.tokens = self.start * int(figures.get("step_tokens") or 0)
        tokens = int(figures.get("step_tokens") or 0)
        self.tokens += tokens
        self._tokens += tokens
        self._seconds += float(figures.get("step_seconds") or 0.0)
        self._steps += 1
        due = step % self.every == 0 or step == self.last_step or figures.get("val_loss") is not None
        if not due:
            return None
        record = self._record(step, figures)
        for writer in self.writers:
            writer.write(step, record)
        self._seconds, self._tokens, self._steps = 0.0, 0, 0
        return record

    def _record(self, step: int, figures: dict[str, float | None]) -> dict:
        record: dict = {"step": step}
        for name in ("loss", "val_loss", "lr", "grad_norm"):
            if figures.get(name) is not None:
                record[name] = float(figures[name])  # type: ignore[arg-type]
        record["tokens"] = self.tokens
        seconds = self._seconds / self._steps
        record["step_seconds"] = seconds
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        record["tokens_per_second"] = rate
        if self.flops_per_token and self.peak_flops:
            achieved = rate * self.flops_per_token / self.processes
            record["tflops_per_gpu"] = achieved / 1e12
            record["mfu"] = achieved / self.peak_flops
        record.update(memory())
        return record

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def memory() -> dict[str, float]:
    """This process's resident memory now and, on a GPU, the peak its tensors took, in MiB."""
    found = {"rss_mib": psutil.Process().memory_info().rss / MIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
    return found


class JsonLines:
    """``metrics.jsonl``: one JSON object per record, each on its own line, flushed as written."""

    def __init__(self, log_dir: str, start: int) -> None:
        self.path = Path(log_dir) / METRICS_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_after(self.path, start)
        self.file = self.path.open("a")

    def write(self, step: int, record: dict) -> None:
        self.file.write(json.dumps(record, allow_nan=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _drop_after(path: Path, step: int) -> None:
    """Keep only the records of steps up to ``step`` (a resumed run does the later ones again)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", math.inf) <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, AttributeError):
            continue  # a line cut short by a run that died while writing it
    partial = path.with_suffix(".jsonl.partial")
    partial.write_text("".join(kept))
    partial.replace(path)


class TensorBoard:
    """TensorBoard's event files: ``train/<figure>`` per record, the validation loss as ``val/loss``."""

    def __init__(self, log_dir: str, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir, purge_step=start + 1, flush_secs=30)

    def write(self, step: int, record: dict) -> None:
        for name, value in record.items():
            if name != "step":
                tag = "val/loss" if name == "val_loss" else f"train/{name}"
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WeightsAndBiases:
    """A Weights & Biases run (``WANDB_MODE=offline`` keeps it on disk), the same figures per record."""

    def __init__(self, project: str, log_dir: str | None, config: dict) -> None:
        import wandb

        self.run = wandb.init(project=project, dir=log_dir, config=config)

    def write(self, step: int, record: dict) -> None:
        self.run.log({name: value for name, value in record.items() if name != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()
