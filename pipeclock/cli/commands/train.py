"""``torchrun --nproc-per-node N -m pipeclock train [...]``: the main job.

The number of stages is the number of processes torchrun starts. Rank 0 prints the progress, then the
run's measurements, and the last line is ``final loss <value> after <N> steps``. The outputs it names
(``--png``, ``--trace``, ...) are checked before the first step, so a bad path costs no training; Ctrl-C
(or the SIGTERM torchrun sends) ends each rank with one line, ``rank 1: interrupted at step 3``.

With ``--checkpoint-dir`` the run saves itself, and with ``--resume`` it continues from the newest
sound checkpoint there (``--resume PATH``: another run's, or one checkpoint), so ``torchrun --max-restarts
K ... --resume`` survives a rank that dies: the survivors fail fast (exit 1), torchrun restarts the group,
and the run goes on from its last checkpoint. With torch 2.13, launch such a job with ``--standalone``
(or ``--rdzv-backend c10d``) and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``restart_warning`` says
why, and which is missing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from pathlib import Path

from pipeclock import comm_blame, comms
from pipeclock.checkpoints.choice import CheckpointError
from pipeclock.cli import config_file, interrupts, stopping
from pipeclock.cli.arguments import (
    Parser,
    check_output,
    link_from,
)
from pipeclock.cli.train_flags import add_arguments
from pipeclock.models.text import CorpusError, bits_per_byte
from pipeclock.observe.report import draw_runs, summary_lines, write_trace
from pipeclock.training.checks import named
from pipeclock.training.loop import TrainConfig, schedule_table, train
from pipeclock.training.progress import Progress
from pipeclock.training.task_choice import make_task
from pipeclock.training.tasks import LanguageTask

DESCRIPTION = (
    "Train a ShardedMLP or a GPT with pipeline parallelism. Each process is one pipeline stage: "
    "torchrun --nproc-per-node P -m pipeclock train runs P stages, or with --dp N, N replicas of P/N "
    "stages each (P processes in all), and with --tp T each stage shared by T ranks (P / (N x T) stages). "
    "Without torchrun it runs the whole model as one stage in one process."
)
# What can go wrong with a run's input, its peers or its files: one line each, no traceback.
EXPECTED_ERRORS = (ValueError, OSError, comms.CommError, CheckpointError, CorpusError)
# What a run writes, and where the command line names it: all checked before the first step.
OUTPUTS = {
    "trace": "--trace",
    "png": "--png",
    "losses": "--losses",
    "checkpoint_dir": "--checkpoint-dir",
    "log_dir": "--log-dir",
}
FOLDERS = ("checkpoint_dir", "log_dir")


def run(args: argparse.Namespace) -> int:
    steps = StepsSeen()
    try:
        return _run_reporting_errors(args, steps)
    except KeyboardInterrupt as interrupt:  # also one raised while an error was being reported
        return _interrupted(interrupts.exit_code(interrupt), steps)
    finally:
        comms.shutdown()


def _run_reporting_errors(args: argparse.Namespace, steps: StepsSeen) -> int:
    try:
        config = TrainConfig.from_args(args)
        for name, option in OUTPUTS.items():
            if getattr(args, name):
                check_output(getattr(args, name), option, folder=name in FOLDERS)
        return _train_and_report(config, args, steps)
    except Exception as error:
        if interrupts.received() is not None:  # a peer stopped first, before this rank's own signal
            return _interrupted(128 + interrupts.received(), steps)
        comm_blame.leave_failure(_first_line(error))  # before this rank's connections close
        if isinstance(error, BrokenPipeError) or not isinstance(error, EXPECTED_ERRORS):
            raise  # a closed output, for the command line to end quietly; or a bug, whose traceback is wanted
        print(f"pipeclock train: error: {_naming_the_rank(error)}", file=sys.stderr, flush=True)
        return 2 if isinstance(error, ValueError) else 1  # a refusal (resume's too), or a failure


def _naming_the_rank(error: BaseException) -> str:
    """The error as raised, ``rank R:`` first when several processes run and it does not say which (a
    refusal every rank reaches alike, such as a config's typo, is then one line a rank, each named)."""
    text = str(error)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return named(text, int(os.environ.get("RANK", "0")))
    return text


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class StepsSeen:
    """The step this rank is in, to say where an interruption found it: a rank still finishing a step
    (its optimizer's update) when a faster peer has reported it is in that step, not the next."""

    def __init__(self) -> None:
        self.current: int | None = None  # None: the steps have not begun

    def begin(self, step: int) -> None:
        self.current = step

    def __call__(self, step: int, loss: float) -> None:
        self.current = step + 1

    def where(self) -> str:
        return "before the first step" if self.current is None else f"at step {self.current}"


def _interrupted(code: int, steps: StepsSeen) -> int:
    """One line per rank (``rank 1: interrupted at step 3``): every rank gets the signal, each says so."""
    signum = code - 128
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    print(f"rank {os.environ.get('RANK', '0')}: {how} {steps.where()}", file=sys.stderr, flush=True)
    return code


def _train_and_report(config: TrainConfig, args: argparse.Namespace, steps: StepsSeen) -> int:
    rank, world = comms.init(timeout=config.timeout)
    if world > 1 and stopping.under_torchrun():
        stopping.report_before_stopping(rank, config.timeout)
    boss = rank == 0
    if boss and world % (config.dp * config.tp) == 0:  # else train() refuses the layout: no headline
        print(_headline(config, world), flush=True)
        warning = restart_warning(dict(os.environ))
        if warning:
            print(f"pipeclock train: warning: {warning}", file=sys.stderr, flush=True)
    text = functools.cache(lambda: make_task(config))  # reads a loss in bits per byte; built once needed
    per_byte = (lambda loss: text().bits_per_byte(loss)) if config.model != "mlp" else bits_per_byte
    step_tokens = config.batch_size * (1 if config.model == "mlp" else config.seq_len)
    progress = Progress(config.steps, enabled=boss, per_byte=per_byte, step_tokens=step_tokens)

    def on_step(step: int, loss: float) -> None:
        steps(step, loss)
        progress(step, loss)

    def on_begin(step: int) -> None:
        steps.begin(step)
        progress.begin(step)
        folders = [folder for folder in (config.checkpoint_dir, config.log_dir) if folder]
        if boss and folders:  # once the run is sure to go ahead: a refused run leaves the old file
            config_file.write_resolved(_resolved(args, config), folders)

    result = train(config, on_step=on_step, on_eval=progress.validation, on_begin=on_begin)
    progress.close()
    if not boss:
        return 0
    if args.losses:
        _write_losses(args.losses, result.first_step, result.losses, result.validation)
    if not result.losses:
        print(f"nothing to train: the checkpoint is at step {result.first_step}, --steps is {config.steps}")
        print(f"final loss {result.final_loss:.6f} after {result.first_step} steps", flush=True)
        return 0
    table = schedule_table(config, world // (config.dp * config.tp))
    if result.validation:
        print("\n" + "\n".join(_validation_lines(result.validation, text())))
    if config.compile:
        print("\n" + compile_line([record.seconds for record in result.records]))
    link = link_from(args)
    print("\n" + "\n".join(summary_lines(result.report, config.schedule, table, config.batch_size, link)))
    if args.trace:
        path = write_trace(result.report, args.trace)
        print(f"\ntrace written to {path} (open it in chrome://tracing or https://ui.perfetto.dev)")
    if args.png:
        path = draw_runs([(config.schedule, result.report, table)], args.png, link=link)
        print(f"timelines drawn to {path}")
    print(f"final loss {result.final_loss:.6f} after {config.steps} steps", flush=True)
    return 0


def compile_line(seconds: list[float]) -> str:
    """The compilation's cost apart from the steps': the first step compiles, the later ones reuse it."""
    line = f"compile: the first step took {seconds[0]:.2f} s (compiling the blocks)"
    if len(seconds) > 1:
        later = sorted(seconds[1:])
        line += f", the later steps {later[len(later) // 2]:.3f} s (median)"
    return line


def _resolved(args: argparse.Namespace, config: TrainConfig) -> str:
    """The run's every flag as TOML, the defaults it resolved itself (a model's steps...) included."""
    parser = Parser(prog="pipeclock train")
    add_arguments(parser)
    return config_file.resolved_toml(parser, args, config.settings())


def _write_losses(
    path: str, first_step: int, losses: list[float], validation: list[tuple[int, float]]
) -> None:
    """Exact values (JSON keeps a float's every digit), so runs can be compared bit for bit: the steps'
    losses, and each validation's (steps done, loss)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    saved = {"first_step": first_step, "losses": losses, "validation": [list(v) for v in validation]}
    Path(path).write_text(json.dumps(saved) + "\n")


def restart_warning(env: dict[str, str]) -> str | None:
    """What to change when ``torchrun --max-restarts K`` (K > 0) keeps one store for every attempt, which a
    restarted group can read the dead attempt's addresses from, and then fail or hang in its first
    collective (pytorch/pytorch#135712); None when the launch restarts safely, or not at all.

    The static rendezvous (torchrun without ``--standalone`` or ``--rdzv-backend c10d``) always keeps it:
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` does not reach it. It is the one whose run id is ``none``.
    """
    if (
        int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0
        or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):
        return None
    if env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1" or env.get("TORCHELASTIC_RUN_ID") == "none":
        return (
            "torchrun's static rendezvous (no --standalone, no --rdzv-backend c10d) keeps one store for "
            "every restart, so a restarted group can read the dead attempt's addresses and fail or hang "
            "(pytorch/pytorch#135712); launch with --standalone on one machine (--rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT on several) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        )
    return (
        "torchrun keeps one store for every restart, so a restarted group can read the dead attempt's "
        "addresses and fail or hang (pytorch/pytorch#135712); launch with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to restart safely"
    )


def _validation_lines(validation: list[tuple[int, float]], task: LanguageTask) -> list[str]:
    """The validation curve, and the bigram byte model's figure on the same held-out bytes beside it."""
    lines = [f"validation ({len(task.validation)} held-out batches): " + task.corpus.summary()]
    lines += [
        f"  after {steps:5d} steps  {loss:.4f} nats/token  {task.readable(loss)}".rstrip()
        for steps, loss in validation
    ]
    baseline, final = task.baseline_bits_per_byte(), task.bits_per_byte(validation[-1][1])
    if baseline is None:  # a token folder: no bytes for the bigram byte model
        return lines
    lines.append(f"  bigram byte model (order 1, fitted on the training split): {baseline:.3f} bits/byte")
    if final < baseline:
        lines.append(f"  the model beats it by {baseline - final:.3f} bits/byte")
    else:
        lines.append(f"  the model is {final - baseline:.3f} bits/byte behind it: train longer")
    return lines


def _headline(config: TrainConfig, world: int) -> str:
    chunks = config.chunks_per_rank()
    per_mb = config.batch_size / config.microbatches
    model = f"ShardedMLP {config.layers} x {config.hidden}"
    if config.model == "gpt":
        model = f"GPT {config.layers} blocks x {config.dim} ({config.heads} heads, seq {config.seq_len})"
    if config.model == "hf":
        model = f"HF {config.hf_config or config.hf_model} (seq {config.seq_len})"
    replicas = f" x {config.dp} replicas ({config.data_parallel})" if config.dp > 1 else ""
    replicas += f", experts over ep {config.ep}" if config.ep > 1 else ""
    replicas = (f" x tp {config.tp}" if config.tp > 1 else "") + replicas
    per_mb /= config.dp
    fitting = f", {config.dtype}" if config.dtype != "fp32" else ""
    fitting += f", recompute {config.recompute}" if config.recompute != "none" else ""
    return (
        f"pipeclock train: {config.schedule}, {world // (config.dp * config.tp)} stage(s) x {chunks} chunk(s)"
        f"{replicas}, "
        f"{config.microbatches} micro-batches of ~{per_mb:g} samples, {model}, {config.steps} steps{fitting}"
    )
