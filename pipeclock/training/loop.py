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

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pipeclock import comms
from pipeclock.checkpoints import folder_lock
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.engine import faults
from pipeclock.engine.actions import Schedule, join_first_stage_backwards
from pipeclock.engine.orchestrator import Pipeline
from pipeclock.observe import run_log
from pipeclock.observe.collectives import timing_collectives
from pipeclock.observe.metrics import GpuUtilization, ProcessMeter, gather_run
from pipeclock.parallel import clip_grad_norm, grad_norm
from pipeclock.plan import run_flops
from pipeclock.plan.memory_fit import check_fits
from pipeclock.training.checkpointing import (
    check_checkpointing,
    checkpoint_due,
    resume_run,
    save_run,
    stages_of,
)
from pipeclock.training.checks import agree, check_loss, check_world, naming_the_rank
from pipeclock.training.compiled import check_compilable
from pipeclock.training.config import MODEL_DEFAULTS, TrainConfig, TrainResult  # noqa: F401 (their home before)
from pipeclock.training.lr_schedule import LRSchedule, scheduler_at
from pipeclock.training.optimizer import build_optimizer
from pipeclock.training.stages import build_pipeline
from pipeclock.training.task_choice import make_task


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
    check_checkpointing(config)
    run_log.check_fresh(config.log_dir, config.resume)
    with _holding_the_folder(config.checkpoint_dir):
        return _train(config, on_step, on_eval, on_begin)


def _train(config: TrainConfig, on_step, on_eval, on_begin) -> TrainResult:
    with naming_the_rank():
        task = _checked_task(config)
        pipe, modules, shard, mesh = build_pipeline(config, task)
    optimizer = build_optimizer(config, unique_parameters(modules))
    resumed, scheduled = resume_run(config, task, modules, optimizer)
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
        if checkpoint_due(config, step + 1):
            position = checkpoint.Position(step + 1, losses[-1], step + 1)
            save_run(config, task, position, modules, optimizer, scheduler)
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
    pp = stages_of(config)
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


def schedule_table(config: TrainConfig, world: int) -> Schedule:
    """The whole pipeline's action lists as the engine runs them (for the predicted timeline)."""
    return join_first_stage_backwards(config.table(world))
