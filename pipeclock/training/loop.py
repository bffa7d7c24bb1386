"""The main job: train a model with pipeline parallelism, one stage (or chunks) per rank.

``--model mlp`` trains ``ShardedMLP`` on the synthetic regression, ``--model gpt`` the GPT on real text
(``pipeclock.training.tasks``); with a language model the validation loss is measured every ``eval_every``
steps with ``Pipeline.evaluate`` (forward only) and shown in bits per byte.

Launched under torchrun, every rank runs ``train``; the number of stages is the number of processes.
Rank 0 is the boss: it shows the progress and, at the end, the measurements of the whole run. The
optimizer is per rank (each rank updates only the parameters it holds), which is all pipeline
parallelism needs: no parameter lives on two ranks. It is torch's Adam or AdamW with weight decay on the
matrices (``training.optimizer``), at the rate ``training.lr_schedule`` gives each step; every step's
rate and whole-model gradient norm (before any clipping) are in the result, beside its loss.

With a checkpoint directory the run saves itself every ``checkpoint_every`` steps and after its last
step (``checkpoints.save_load``), and holds the directory for its whole life, so that no second run
saves there meanwhile (``checkpoints.folder_lock``); with ``resume`` it continues from the newest sound
checkpoint there (or the run or checkpoint ``resume`` names, ``checkpoints.resume``), whatever the
number of stages that saved it. Since batch k depends only on (seed, k), a resumed run sees the data the
uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from pipeclock import comms
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.checkpoints import folder_lock, resume
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.engine import faults
from pipeclock.engine.actions import Schedule, join_first_stage_backwards, num_chunks, placement_of
from pipeclock.engine.csv_schedule import load_csv
from pipeclock.engine.generators import chunks_of, generate, get_schedule, supports_chunks
from pipeclock.engine.orchestrator import Pipeline, StepRecord
from pipeclock.models.text import bits_per_byte
from pipeclock.observe import run_log
from pipeclock.observe.collectives import timing_collectives
from pipeclock.observe.metrics import GpuUtilization, ProcessMeter, RunReport, gather_run
from pipeclock.parallel import clip_grad_norm, grad_norm
from pipeclock.plan import run_flops
from pipeclock.plan.memory_fit import check_fits
from pipeclock.training.balance import check_balance
from pipeclock.training.checks import agree, check_loss, check_values, check_world, naming_the_rank
from pipeclock.training.compiled import check_compilable
from pipeclock.training.lr_schedule import LRSchedule, resume_line, scheduler_at
from pipeclock.training.optimizer import build_optimizer, group_settings, parse_betas, restore_settings
from pipeclock.training.stages import build_pipeline
from pipeclock.training.task_choice import make_task

# Per model, the defaults of the fields left at None. The MLP is wide enough that each micro-batch's
# compute dwarfs the cost of a message, so the measured bubble is the schedule's, yet a run takes about
# 20 s on 2 CPU cores. The GPT learns visibly (validation well under the bigram baseline) in about two
# minutes on 2 cores. The MLP's learning rate: at 1e-3 its 16 unnormalised layers overshoot (the loss
# climbs at steps 8-14 and levels off near 0.085 after 60 steps, and any rounding, bf16's or a 0.1 %
# change of rate, sends the run elsewhere); at 3e-4 the loss falls smoothly to 0.054, and bf16 ends 20
# steps within 2 % of float32.
MODEL_DEFAULTS = {
    "mlp": {"layers": 16, "batch_size": 128, "steps": 60, "lr": 3e-4},
    "gpt": {"layers": 4, "batch_size": 16, "steps": 600, "lr": 3e-3},
    "hf": {"layers": 1, "batch_size": 16, "steps": 200, "lr": 1e-3},  # layers: the HF config's (unused)
}


@dataclass
class TrainConfig:
    model: str = "mlp"  # "mlp", "gpt" or "hf"
    schedule: str = "1f1b"
    schedule_csv: str | None = None  # a schedule from a file (torch's CSV): it replaces ``schedule``
    microbatches: int | None = None  # None: 8, or the schedule file's
    chunks: int | None = None  # None: 2 for interleaving schedules, else 1
    hidden: int = 1024  # the MLP's width
    layers: int | None = None  # the MLP's Linear layers, or the GPT's blocks
    dim: int = 128  # the GPT's width
    heads: int = 4
    seq_len: int = 128
    dropout: float = 0.0
    data: str | None = None  # a text file or folder, or a token folder; None: the standard library's sources
    token_dtype: str | None = None  # a nanoGPT folder's uint16 (default) or uint32; a prepared one's own
    eval_every: int = 50  # validation every N steps (and after the last); 0: only after the last
    eval_batches: int = 4
    batch_size: int | None = None
    steps: int | None = None
    lr: float | None = None  # the peak rate, after any warm-up
    optimizer: str = "adam"  # "adam" or "adamw" (torch.optim's, fused where the device has it)
    weight_decay: float = 0.0  # adamw: on every parameter with 2+ dimensions (``training.optimizer``)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: str = "constant"  # "constant", "cosine", "linear" or "wsd" (``training.lr_schedule``)
    warmup_steps: int = 0  # the rate climbs linearly to lr over these first steps
    min_lr: float = 0.0  # where a decay ends
    decay_steps: int | None = None  # wsd: the last N steps decay to min_lr
    seed: int = 0
    timeout: float = 60.0
    measure_memory: bool = True
    recompute: str = "none"  # "none", "full" or "every-K": activation recompute per chunk
    dtype: str = "fp32"  # "fp32", or "bf16": autocast compute and bf16 messages, float32 weights
    checkpoint_dir: str | None = None  # None: no checkpoints
    checkpoint_every: int = 0  # 0: only after the last step
    resume: bool | str = False  # True: checkpoint_dir's newest sound one; a path: that run's, or that one
    keep_last: int = 0  # after each save, keep only the newest N checkpoints; 0: keep every one
    dp: int = 1  # data-parallel replicas of the pipeline: pp = processes / (dp x tp)
    tp: int = 1  # tensor-parallel ranks sharing each stage (innermost in the mesh)
    tp_plan: str | None = None  # a JSON plan in transformers' base_model_tp_plan format; None: the model's
    ep: int = 1  # expert-parallel ranks, carved from dp: each MoE layer's experts divided over them
    ep_plan: str | None = None  # a JSON plan in transformers' base_model_ep_plan format; None: the model's
    tp_timed_steps: int = 3  # with tp: steps profiled for the time inside tp's collectives (0: none)
    data_parallel: str = "fsdp"  # "fsdp" (FSDP2, sharded) or "ddp" (full copies)
    clip_grad_norm: float | None = None  # the whole model's gradient norm at most this; None: no clipping
    balance: str = "layers"  # cut the model by layer count, or by measured time or memory per layer
    hf_config: str | None = None  # --model hf: a config.json (or its directory), random weights
    hf_model: str | None = None  # --model hf: a local from_pretrained directory, its weights
    trust_remote_code: bool = False  # --model hf: run the model's own Python code (a config's auto_map)
    compile: bool = False  # torch.compile each repeated block (GPT block, HF decoder layer)
    log_dir: str | None = None  # metrics.jsonl and TensorBoard's event files (observe.run_log)
    log_every: int = 10  # a record every N steps (and after the last, and with each validation loss)
    wandb: str | None = None  # a Weights & Biases project the same records go to

    def __post_init__(self) -> None:
        if self.model not in MODEL_DEFAULTS:
            raise ValueError(f"unknown model {self.model!r}: use one of {', '.join(MODEL_DEFAULTS)}")
        for name, value in MODEL_DEFAULTS[self.model].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self._table = None
        if self.schedule_csv:
            self._table = load_csv(self.schedule_csv)
            found = 1 + max(a.microbatch for row in self._table for a in row)
            if self.microbatches not in (None, found):
                raise ValueError(
                    f"{self.schedule_csv} has {found} micro-batches, not --microbatches {self.microbatches}"
                )
            self.microbatches, self.schedule = found, Path(self.schedule_csv).name
        if isinstance(self.betas, str):  # "0.9,0.95", as a config file may give it
            self.betas = parse_betas(self.betas)
        self.betas = tuple(self.betas)
        if self.microbatches is None:  # 8, unless a replica's share of the batch is smaller
            self.microbatches = min(8, max(1, self.batch_size // max(1, self.dp)))
        check_values(self)
        check_balance(self.balance)
        if self.log_every < 1:
            raise ValueError(f"--log-every must be a positive integer, got {self.log_every}")
        run_log.check_available(self.log_dir, self.wandb)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> TrainConfig:
        """The config a command line asks for: every field ``args`` carries, then ``overrides``.

        A lab's parser has only some of the flags; the fields it lacks keep their defaults.
        """
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **overrides})

    def settings(self) -> dict:
        """The run's settings as plain values, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def chunks_per_rank(self) -> int:
        if self._table is not None:
            return num_chunks(self._table)
        if self.chunks is not None:
            return self.chunks
        return chunks_of(self.schedule) or (2 if supports_chunks(get_schedule(self.schedule)) else 1)

    def table(self, world: int) -> Schedule:
        """Every rank's actions, with their placement: the file's, or the named schedule's."""
        if self._table is not None:
            if len(self._table) != world:
                raise ValueError(
                    f"{self.schedule_csv} is a schedule for {len(self._table)} ranks, not {world}"
                )
            return self._table
        table = generate(self.schedule, world, self.microbatches, self.chunks_per_rank())
        return table if isinstance(table, Schedule) else Schedule(table, placement_of(table))


@dataclass
class TrainResult:
    losses: list[float]
    records: list[StepRecord]
    report: RunReport | None  # on rank 0
    modules: list[torch.nn.Module] = field(repr=False, default_factory=list)
    first_step: int = 0  # losses[i] is step first_step + i; > 0 when resumed
    resumed_loss: float | None = None  # the checkpoint's last loss, when resumed
    validation: list[tuple[int, float]] = field(default_factory=list)  # (steps done, loss), language models
    lrs: list[float] = field(default_factory=list)  # lrs[i]: the learning rate step first_step + i used
    grad_norms: list[float] = field(default_factory=list)  # its whole model's gradient norm, before clipping

    @property
    def final_loss(self) -> float | None:
        """The loss of the run's last step, even when a resumed run had no step left to do."""
        return self.losses[-1] if self.losses else self.resumed_loss


def unique_parameters(modules: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Every parameter once, even one that two chunks share (a tie on one rank)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for parameter in module.parameters():
            seen.setdefault(id(parameter), parameter)
    return list(seen.values())


def train(config: TrainConfig, on_step=None, on_eval=None, on_begin=None) -> TrainResult:
    """Run the steps up to ``config.steps``; ``on_step(step, loss)`` is called on every rank after each,
    ``on_begin(step)`` before the first (the step a resumed run starts at).

    For a language model ``on_eval(steps_done, loss)`` follows each validation (every ``eval_every``
    steps and after the last). Before the first step the ranks agree on the configuration, and the
    processes and (the planner's estimate) the memory are checked to fit it; a loss that is not a finite
    number stops every rank at that step, before its optimizer step and any checkpoint of it.
    """
    comms.init(timeout=config.timeout)
    faults.arm(comms.get_world_size())
    agree(config)
    _check_checkpointing(config)
    run_log.check_fresh(config.log_dir, config.resume)
    with _holding_the_folder(config.checkpoint_dir):
        return _train(config, on_step, on_eval, on_begin)


def _train(config: TrainConfig, on_step, on_eval, on_begin) -> TrainResult:
    with naming_the_rank():
        task = _checked_task(config)
        pipe, modules, shard, mesh = build_pipeline(config, task)
    optimizer = build_optimizer(config, unique_parameters(modules))
    resumed, scheduled = _resume(config, task, modules, optimizer)
    start = resumed.step if resumed else 0
    if start >= config.steps:  # resumed from the run's last checkpoint: nothing left to do
        return TrainResult([], [], None, modules, start, resumed.loss)
    scheduler = scheduler_at(optimizer, LRSchedule.of(config), scheduled)
    pipe.steps_done = start
    if on_begin:
        on_begin(start)
    meter, gpu = ProcessMeter(), GpuUtilization()
    losses, records, validation, lrs, norms = [], [], [], [], []
    timed = timed_steps(start, config.steps, config.tp_timed_steps if config.tp > 1 else 0)
    step_tokens = config.batch_size * (1 if config.model == "mlp" else config.seq_len)
    log = _run_log(config, task, start)
    for step in range(start, config.steps):
        began = time.perf_counter()
        inputs, targets = task.batch(step, config.batch_size, shard)  # this replica's rows alone
        optimizer.zero_grad(set_to_none=True)
        losses.append(_step(pipe, inputs, targets, step in timed))
        check_loss(losses[-1], step)
        norms.append(_gradient_norm(pipe, config.clip_grad_norm, mesh))
        lrs.append(optimizer.param_groups[0]["lr"])  # this step's rate, set by the scheduler
        optimizer.step()
        scheduler.step()
        records.append(pipe.last)
        figures = {
            "loss": losses[-1],
            "lr": lrs[-1],
            "grad_norm": norms[-1],
            "step_seconds": time.perf_counter() - began,
            "step_tokens": step_tokens,
        }
        if on_step:
            on_step(step, losses[-1])
        if _evaluation_due(config, task, step + 1):
            validation.append((step + 1, _validate(pipe, task, shard)))
            figures["val_loss"] = validation[-1][1]
            if on_eval:
                on_eval(*validation[-1])
        if log:
            log.log(step + 1, figures)
        if _checkpoint_due(config, step + 1):
            position = checkpoint.Position(step + 1, losses[-1], step + 1)
            _save(config, task, position, modules, optimizer, scheduler)
    if log:
        log.close()
    report = gather_run(records, meter, gpu, chunks=len(modules))
    result = TrainResult(losses, records, report, modules, start, resumed.loss if resumed else None)
    result.validation, result.lrs, result.grad_norms = validation, lrs, norms
    return result


def _gradient_norm(pipe: Pipeline, clip: float | None, mesh) -> float:
    """The whole model's gradient norm (every stage, replica and tp rank), clipped to ``clip`` after
    it is measured when one is given: the same sum of squares and one scalar all-reduce either way."""
    if clip is not None:
        return clip_grad_norm(pipe, clip, mesh)
    return grad_norm(pipe, mesh)


def timed_steps(first: int, steps: int, count: int) -> range:
    """The steps profiled for tensor parallel's collectives (``observe.collectives``): up to ``count``,
    every other step from the third this process runs (the first is the warm-up), so that untimed steps,
    which the run's other figures describe, lie between them and the warm-up."""
    return range(first + 2, min(steps, first + 2 + 2 * count), 2)


def _step(pipe: Pipeline, inputs, targets, timed: bool) -> float:
    """One step; a timed one is profiled, its record given the time inside the functional collectives,
    and the ranks line up after it (each takes its own time to stop the profiler)."""
    if not timed:
        return pipe.step(inputs, targets)
    with timing_collectives() as found:
        loss = pipe.step(inputs, targets)
    pipe.last.collective_seconds, pipe.last.collective_calls = found.seconds, found.calls
    comms.barrier("lining up after a step profiled for tensor parallel's collectives")
    return loss


def _run_log(config: TrainConfig, task, start: int) -> run_log.RunLog | None:
    """Rank 0's log of the run's figures (``observe.run_log``), when ``--log-dir`` or ``--wandb`` asks for
    one; None on the other ranks and without either. Each record is flushed as written, so a run that
    stops early keeps what it logged."""
    if comms.get_rank() != 0 or not (config.log_dir or config.wandb):
        return None
    return run_log.RunLog(
        config.log_dir, config.log_every, config.steps, start, config.wandb,
        flops_per_token=run_flops.flops_per_token(config, task),
        peak_flops=run_flops.device_peak(comms.device(), config.dtype),
        processes=comms.get_world_size(), config=config.settings(),
    )  # fmt: skip


@contextmanager
def _holding_the_folder(directory: str | None) -> Iterator[None]:
    """The run's checkpoint folder locked by rank 0 for the run's life (``folder_lock``); every rank
    refuses, in rank 0's words, when another run holds it."""
    if not directory:
        yield
        return
    held, refusal = None, None
    if comms.get_rank() == 0:
        try:
            held = folder_lock.lock(directory)
        except folder_lock.FolderInUseError as error:
            refusal = str(error)
        except OSError as error:  # rank 0 alone would fail: the others must hear it, not wait
            refusal = f"--checkpoint-dir {directory}: cannot lock it ({error.strerror})"
    refusal = comms.all_gather_object(refusal, f"locking --checkpoint-dir {directory}")[0]
    try:
        if refusal:
            raise folder_lock.FolderInUseError(f"rank {comms.get_rank()}: {refusal}")
        yield
    finally:
        if held is not None:
            folder_lock.release(held)


def _checked_task(config: TrainConfig):
    """The task, once the run is known to fit the processes and (the planner's estimate) the memory."""
    world = comms.get_world_size()
    check_world(config, world)
    task = make_task(config)
    check_compilable(config, getattr(task, "hf_config", None))
    pp = _stages(config)
    if config.tp > 1:  # the model's own checks (heads, widths): before any rank waits for another
        task.tp_plan(config.tp, None, config.table(pp).placement.num_virtual)
    check_fits(config, config.table(pp), comms.get_rank() // config.tp % pp, comms.device())
    return task


def _evaluation_due(config: TrainConfig, task, steps_done: int) -> bool:
    if not task.validation:
        return False
    every = config.eval_every
    return steps_done == config.steps or (every > 0 and steps_done % every == 0)


def _validate(pipe: Pipeline, task, shard: slice) -> float:
    """The mean loss over the task's held-out batches, forward only (each replica its shard)."""
    losses = [pipe.evaluate(inputs[shard], targets[shard]) for inputs, targets in task.validation]
    return sum(losses) / len(losses)


CHECKPOINT_FLAGS = {
    "--resume": "resume",
    "--checkpoint-every": "checkpoint_every",
    "--keep-last": "keep_last",
}


def _check_checkpointing(config: TrainConfig) -> None:
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


def _checkpoint_due(config: TrainConfig, steps_done: int) -> bool:
    if not config.checkpoint_dir:
        return False
    every = config.checkpoint_every
    return steps_done == config.steps or (every > 0 and steps_done % every == 0)


def _resume(config: TrainConfig, task, modules, optimizer) -> tuple[checkpoint.Position | None, int]:
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
    before = _layout(saved["stages"], saved.get("replicas", 1), saved.get("tp", 1))
    now = _layout(_stages(config), config.dp, config.tp).removesuffix(" stage(s)")
    _say(f"resumed from {found} at step {position.step} (saved by {before}, now {now})")
    changed = resume.changes(saved, config)
    if changed:
        _say("resume: " + "; ".join(changed))
    decay = resume_line(saved.get("settings", {}), LRSchedule.of(config), scheduled)
    if decay:
        _say(decay)
    return position, scheduled


def _layout(stages: int, replicas: int, tp: int = 1) -> str:
    return (
        f"{stages} stage(s)"
        + (f" x tp {tp}" if tp > 1 else "")
        + (f" x {replicas} replicas" if replicas > 1 else "")
    )


def _stages(config: TrainConfig) -> int:
    return comms.get_world_size() // (config.dp * config.tp)


def _save(config: TrainConfig, task, position: checkpoint.Position, modules, optimizer, scheduler) -> None:
    run = {
        **task.run_info(),
        "schedule": config.schedule,
        "chunks": config.chunks_per_rank(),
        "stages": _stages(config),
        "replicas": config.dp,
        "tp": config.tp,
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


def schedule_table(config: TrainConfig, world: int) -> Schedule:
    """The whole pipeline's action lists as the engine runs them (for the predicted timeline)."""
    return join_first_stage_backwards(config.table(world))


class Progress:
    """Rank 0's progress: on a terminal a bar (step, loss, tokens/s, time left), a line every tenth of
    the run otherwise."""

    def __init__(
        self,
        steps: int,
        enabled: bool,
        per_byte: Callable[[float], float | None] = bits_per_byte,
        step_tokens: int = 0,
        stream=None,
    ):
        """``per_byte``: a validation loss (nats per token) in bits per byte of the text (None: unknown);
        ``step_tokens``: the tokens of a step (the bar shows tokens/s); ``stream``: where the bar goes."""
        self.steps, self.enabled, self.per_byte = steps, enabled, per_byte
        self.step_tokens, self.stream = step_tokens, stream or sys.stderr
        self.bar = None
        self.on_terminal = enabled and self.stream.isatty()

    def begin(self, step: int) -> None:
        """The run starts at ``step`` (after a resume: the bar counts only this run's steps in its rate)."""
        if self.on_terminal and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.steps, initial=step, unit="step", dynamic_ncols=True, file=self.stream)
            self.began = time.perf_counter()

    def __call__(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.on_terminal:
            self.begin(step)
            shown = {"loss": f"{loss:.4f}"}
            elapsed = time.perf_counter() - self.began
            if self.step_tokens and elapsed > 0:  # this run's steps so far, this one included
                shown["tok/s"] = f"{(self.bar.n + 1 - self.bar.initial) * self.step_tokens / elapsed:,.0f}"
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update()
        elif step % max(1, self.steps // 10) == 0 or step == self.steps - 1:
            print(f"step {step:5d}  loss {loss:.6f}", flush=True)

    def validation(self, steps_done: int, loss: float) -> None:
        if not self.enabled:
            return
        per_byte = self.per_byte(loss)
        line = f"validation after {steps_done} steps: {loss:.4f} nats/token" + (
            f", {per_byte:.3f} bits/byte" if per_byte is not None else ""
        )
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
