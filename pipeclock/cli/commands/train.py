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
    add_link_arguments,
    check_output,
    link_from,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
)
from pipeclock.engine.generators import SCHEDULES
from pipeclock.engine.precision import DTYPES
from pipeclock.engine.recompute import POLICY_HELP
from pipeclock.models.text import CorpusError, bits_per_byte
from pipeclock.observe import run_log
from pipeclock.observe.report import draw_runs, summary_lines, write_trace
from pipeclock.training.loop import MODEL_DEFAULTS, Progress, TrainConfig, schedule_table, train
from pipeclock.training.lr_schedule import SCHEDULES as LR_SCHEDULES
from pipeclock.training.optimizer import OPTIMIZERS, parse_betas
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainConfig()
    if isinstance(parser, Parser):  # the command's own parser reads --config's file into its arguments
        parser.expand_arguments = config_file.expand
    parser.add_argument(
        "--config", metavar="FILE.toml",
        help="read flags from a TOML file: each key is a flag without its dashes (weight-decay = 0.1, or "
        "weight_decay; a switch is true or false; [tables] only group keys); flags on the command line "
        f"win. The run's resolved flags are written as {config_file.RESOLVED_NAME} in --checkpoint-dir "
        "and --log-dir, and --config reads that file back to the same run",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=defaults.model, choices=list(MODEL_DEFAULTS),
        help="mlp: ShardedMLP on a synthetic regression; gpt: a GPT on real text; hf: a Hugging Face "
        "causal LM (--hf-config or --hf-model) on real text (default: mlp)",
    )  # fmt: skip
    parser.add_argument(
        "--hf-config", metavar="PATH",
        help="--model hf: a Hugging Face config.json, or a directory holding one (random initial weights)",
    )  # fmt: skip
    parser.add_argument(
        "--hf-model", metavar="DIR",
        help="--model hf: a local from_pretrained directory (config.json and safetensors weights)",
    )  # fmt: skip
    parser.add_argument(
        "--trust-remote-code", action="store_true",
        help="--model hf: run the Python code a config names (auto_map), for a model transformers does "
        "not know; off by default: only for code you have read or trust",
    )  # fmt: skip
    parser.add_argument(
        "--schedule", default=defaults.schedule, choices=list(SCHEDULES), metavar="NAME",
        help=f"the pipeline schedule: {', '.join(SCHEDULES)} (default {defaults.schedule}); the number of "
        "stages is the number of processes torchrun starts (--nproc-per-node)",
    )  # fmt: skip
    parser.add_argument(
        "--balance", default=defaults.balance, choices=("layers", "time", "memory"),
        help="where the model is cut: equal layer counts (default), or equal measured time (F + B) or "
        "memory per stage, from a short profile of each layer on rank 0",
    )  # fmt: skip
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        help="micro-batches per step (default 8, fewer if a replica's share of --batch-size is smaller; "
        "or the --schedule-csv file's)",
    )
    parser.add_argument(
        "--schedule-csv", metavar="FILE",
        help="run the schedule in FILE (torch.distributed.pipelining's compute_only CSV) instead of "
        "--schedule: its ranks, micro-batches and placement come from the file",
    )  # fmt: skip
    parser.add_argument(
        "--chunks", type=positive_int, default=None, help="model chunks per rank (default: 2 if interleaved)"
    )
    mlp, gpt = MODEL_DEFAULTS["mlp"], MODEL_DEFAULTS["gpt"]
    parser.add_argument("--hidden", type=positive_int, default=defaults.hidden, help="the MLP's width")
    parser.add_argument(
        "--layers", type=positive_int,
        help=f"the MLP's Linear layers (default {mlp['layers']}) or the GPT's blocks ({gpt['layers']})",
    )  # fmt: skip
    parser.add_argument("--dim", type=positive_int, default=defaults.dim, help="the GPT's width")
    parser.add_argument(
        "--heads", type=positive_int, default=defaults.heads, help="the GPT's attention heads"
    )
    parser.add_argument(
        "--seq-len", type=positive_int, default=defaults.seq_len, help="the GPT's tokens per sample"
    )
    parser.add_argument("--dropout", type=probability, default=defaults.dropout, help="the GPT's dropout")
    parser.add_argument(
        "--data", metavar="PATH",
        help="a text file or folder for the GPT (default: the Python standard library's own sources), or a "
        "folder of tokens read memory-mapped: one `pipeclock prepare` wrote (dataset.json), or nanoGPT's "
        "train.bin and val.bin (its meta.pkl's vocab_size, if any); batch k is windows of the token stream "
        "drawn from (--seed, k) alone",
    )  # fmt: skip
    parser.add_argument(
        "--token-dtype", choices=["uint16", "uint32"], metavar="uint16|uint32",
        help="the ids' type in nanoGPT's train.bin and val.bin (default uint16); a prepared folder's "
        "dataset.json says its own, which this must match",
    )  # fmt: skip
    parser.add_argument(
        "--eval-every", type=non_negative_int, default=defaults.eval_every, metavar="N",
        help="the GPT's validation loss every N steps, and after the last (0: only after the last)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-batches", type=positive_int, default=defaults.eval_batches, metavar="N",
        help="held-out batches per validation",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=positive_int,
        help=f"samples per step (default {mlp['batch_size']} for mlp, {gpt['batch_size']} for gpt)",
    )  # fmt: skip
    parser.add_argument(
        "--steps",
        type=positive_int,
        help=f"training steps (default {mlp['steps']} for mlp, {gpt['steps']} for gpt)",
    )
    parser.add_argument(
        "--lr",
        type=positive_float,
        help=f"the peak learning rate, reached after any warm-up (default {mlp['lr']:g} for mlp, "
        f"{gpt['lr']:g} for gpt)",
    )
    _add_optimizer_arguments(
        parser.add_argument_group("the optimizer and its learning-rate schedule"), defaults
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=defaults.seed,
        help="seeds the weights, the data and dropout (default 0)",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=defaults.timeout, help="seconds any blocking call may wait"
    )
    parser.add_argument(
        "--dp", type=positive_int, default=defaults.dp, metavar="N",
        help="data-parallel replicas of the pipeline: the processes form a (dp, pp) mesh, pp = processes / N "
        "(default 1); each replica takes a contiguous shard of --batch-size, which stays the global batch",
    )  # fmt: skip
    parser.add_argument(
        "--tp", type=positive_int, default=defaults.tp, metavar="N",
        help="tensor-parallel ranks per stage (default 1): each of a stage's N ranks holds 1/N of its "
        "split matrices (torch's parallelize_module, the model's own plan); processes = dp x pp x N",
    )  # fmt: skip
    parser.add_argument(
        "--tp-plan", metavar="FILE",
        help="with --tp: the plan as a JSON file in transformers' base_model_tp_plan format "
        '({"layers.*.mlp.up_proj": "colwise", ...}), for a model without one or to replace its own',
    )  # fmt: skip
    parser.add_argument(
        "--ep", type=positive_int, default=defaults.ep, metavar="N",
        help="expert-parallel ranks (default 1): each MoE layer's experts divided over N of a stage's dp "
        "ranks (N divides --dp), tokens sent to their expert's rank and back by all-to-all",
    )  # fmt: skip
    parser.add_argument(
        "--ep-plan", metavar="FILE",
        help="with --ep: the plan as a JSON file in transformers' base_model_ep_plan format "
        '({"layers.*.mlp.experts": "ep_dispatch_experts", ...}), for a model without one or to replace '
        "its own",
    )  # fmt: skip
    parser.add_argument(
        "--tp-timed-steps", type=non_negative_int, default=defaults.tp_timed_steps, metavar="N",
        help="with --tp: steps profiled (torch.profiler) for the time inside tensor parallel's "
        "collectives, which the summary reports; they are left out of its other figures "
        f"(default {defaults.tp_timed_steps}, 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--data-parallel", default=defaults.data_parallel, choices=["fsdp", "ddp"],
        help="what keeps the replicas in step: fsdp (FSDP2, parameters and optimizer state sharded over "
        "the replicas; default) or ddp (full copies)",
    )  # fmt: skip
    parser.add_argument(
        "--clip-grad-norm", type=positive_float, metavar="X",
        help="scale the gradients so that the whole model's norm (every stage, every replica, counted "
        "once) is at most X, as clip_grad_norm_ on one process",
    )  # fmt: skip
    parser.add_argument(
        "--recompute", default=defaults.recompute, metavar="POLICY",
        help=f"activation recompute: {POLICY_HELP}; full keeps only each chunk's input per micro-batch and "
        "runs its forward again in the backward (same math, less memory, about one more forward)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default=defaults.dtype, choices=list(DTYPES),
        help="fp32, or bf16: forwards under autocast, float32 weights, gradients and optimizer state, "
        "bf16 messages between stages (faster only where the hardware has bf16: GPUs, CPUs with "
        "AVX512-BF16 or AMX)",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action="store_true",
        help="torch.compile each repeated block (a GPT block, an HF decoder layer) on every stage; the "
        "first step pays the compilation, reported apart from the other steps",
    )  # fmt: skip
    parser.add_argument("--trace", metavar="FILE", help="write the run's timeline as a Chrome trace (JSON)")
    parser.add_argument("--png", metavar="FILE", help="draw the predicted and measured timelines")
    add_link_arguments(parser.add_argument_group("what the prediction charges each message"))
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save checkpoints in DIR (after the last step, at least)"
    )
    parser.add_argument(
        "--checkpoint-every", metavar="N", type=non_negative_int, default=defaults.checkpoint_every,
        help="also save every N steps (default: only after the last step)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", nargs="?", const=True, default=False, metavar="PATH",
        help="continue from the newest sound checkpoint in --checkpoint-dir (starts fresh, and says so, "
        "when there is none; a damaged newer one is skipped, and named), or from the run directory or the "
        "one step_NNNNNN checkpoint PATH names, with any number of stages. The model and --seed must be "
        "the checkpoint's; this command's training flags (defaults included) win, each change printed. "
        "With torchrun "
        "--max-restarts, a restarted group goes on from the newest checkpoint",
    )  # fmt: skip
    parser.add_argument(
        "--keep-last", metavar="N", type=int, default=defaults.keep_last,
        help="after each save, delete all but the newest N sound checkpoints in --checkpoint-dir (never "
        "the one just written, never a .partial save in progress; default: keep all)",
    )  # fmt: skip
    parser.add_argument(
        "--losses", metavar="FILE",
        help='write the loss of every step this run did as JSON: {"first_step": s, "losses": [...], '
        '"validation": [[steps done, loss], ...]}',
    )  # fmt: skip
    logs = parser.add_argument_group("metrics a team can watch (rank 0 writes them)")
    logs.add_argument(
        "--log-dir", metavar="DIR",
        help=f"write {run_log.METRICS_NAME} (one JSON object per record: step, loss, lr, grad_norm when "
        "measured, tokens, tokens_per_second, step_seconds, memory, val_loss, and on a GPU tflops_per_gpu "
        "and mfu) and TensorBoard's event files (tensorboard --logdir DIR) in DIR; a fresh run refuses a "
        "DIR holding another run's records, a resumed one replaces those of the steps it does again",
    )  # fmt: skip
    logs.add_argument(
        "--log-every", metavar="N", type=positive_int, default=defaults.log_every,
        help="a record every N steps (figures over the steps since the last one), after the last step "
        "and with each validation loss",
    )  # fmt: skip
    logs.add_argument(
        "--wandb", metavar="PROJECT",
        help="send the same records to this Weights & Biases project (needs the wandb package; "
        "WANDB_MODE=offline keeps the run on disk, with no network)",
    )  # fmt: skip


def _add_optimizer_arguments(group, defaults: TrainConfig) -> None:
    group.add_argument(
        "--optimizer", default=defaults.optimizer, choices=list(OPTIMIZERS),
        help="torch.optim's Adam or AdamW (decoupled weight decay), fused where the device has the "
        f"kernel (CPU, CUDA), else foreach (default {defaults.optimizer})",
    )  # fmt: skip
    group.add_argument(
        "--weight-decay", type=non_negative_float, default=defaults.weight_decay, metavar="X",
        help="adamw's weight decay, on every parameter with two or more dimensions (matrices, embeddings; "
        "a tied weight once), never on biases or norm weights; refused with adam, where it would be an "
        "L2 penalty (default 0)",
    )  # fmt: skip
    group.add_argument(
        "--betas", type=_betas, default=defaults.betas, metavar="B1,B2",
        help="the decay rates of the moment estimates, each in [0, 1) (default 0.9,0.999)",
    )  # fmt: skip
    group.add_argument(
        "--eps", type=positive_float, default=defaults.eps,
        help=f"added to the update's denominator (default {defaults.eps:g})",
    )  # fmt: skip
    group.add_argument(
        "--lr-schedule", default=defaults.lr_schedule, choices=list(LR_SCHEDULES),
        help="the rate after the warm-up: constant --lr; cosine or linear from --lr down to --min-lr over "
        "the rest of the run; wsd: --lr, then linear down to --min-lr over the last --decay-steps "
        f"(default {defaults.lr_schedule}). A resumed run continues the same curve",
    )  # fmt: skip
    group.add_argument(
        "--warmup-steps", type=non_negative_int, default=defaults.warmup_steps, metavar="W",
        help="step s < W runs at --lr x (s + 1) / W (default 0: no warm-up; at most --steps)",
    )  # fmt: skip
    group.add_argument(
        "--min-lr", type=non_negative_float, default=defaults.min_lr, metavar="X",
        help="where a cosine, linear or wsd decay ends, at most --lr (default 0)",
    )  # fmt: skip
    group.add_argument(
        "--decay-steps", type=positive_int, default=defaults.decay_steps, metavar="N",
        help="--lr-schedule wsd: the last N steps decay (default: none, which wsd refuses; at most --steps "
        "less the warm-up)",
    )  # fmt: skip


def _betas(text: str) -> tuple[float, float]:
    try:
        return parse_betas(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be two numbers B1,B2 (e.g. 0.9,0.95), got {text!r}") from None


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
        print(f"pipeclock train: error: {error}", file=sys.stderr, flush=True)
        return 2 if isinstance(error, ValueError) else 1  # a refusal (resume's too), or a failure


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
    replicas = (f" x tp {config.tp}" if config.tp > 1 else "") + replicas
    per_mb /= config.dp
    fitting = f", {config.dtype}" if config.dtype != "fp32" else ""
    fitting += f", recompute {config.recompute}" if config.recompute != "none" else ""
    return (
        f"pipeclock train: {config.schedule}, {world // (config.dp * config.tp)} stage(s) x {chunks} chunk(s)"
        f"{replicas}, "
        f"{config.microbatches} micro-batches of ~{per_mb:g} samples, {model}, {config.steps} steps{fitting}"
    )
