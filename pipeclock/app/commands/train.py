"""``torchrun --nproc-per-node N -m pipeclock train [...]``: the main job.

The number of stages is the number of processes torchrun starts. Rank 0 prints the progress, then the
run's measurements, and the last line is ``final loss <value> after <N> steps``.

With ``--checkpoint-dir`` the run saves itself, and with ``--resume`` it continues from the newest
checkpoint there, so ``torchrun --max-restarts K ... --resume`` survives a rank that dies: the survivors
fail fast (exit 1), torchrun restarts the group, and the run goes on from its last checkpoint. With
torch 2.13, launch such a job with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default torchrun keeps
one store for every attempt, and a restarted group can read the dead attempt's addresses from it and fail
or hang in its first collective (pytorch/pytorch#135712).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pipeclock import comms
from pipeclock.app import stopping
from pipeclock.app.checkpoint import CheckpointError
from pipeclock.app.tasks import LanguageTask
from pipeclock.app.train import MODEL_DEFAULTS, Progress, TrainConfig, schedule_table, train
from pipeclock.engine.generators import SCHEDULES
from pipeclock.engine.precision import DTYPES
from pipeclock.engine.recompute import POLICY_HELP
from pipeclock.models.text import CorpusError, bits_per_byte
from pipeclock.observe.report import draw_runs, summary_lines, write_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainConfig()
    parser.add_argument(
        "--model", default=defaults.model, choices=list(MODEL_DEFAULTS),
        help="mlp: ShardedMLP on a synthetic regression; gpt: a GPT on real text (default: mlp)",
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
        type=int,
        help="micro-batches per step (default 8, fewer if a replica's share of --batch-size is smaller; "
        "or the --schedule-csv file's)",
    )
    parser.add_argument(
        "--schedule-csv", metavar="FILE",
        help="run the schedule in FILE (torch.distributed.pipelining's compute_only CSV) instead of "
        "--schedule: its ranks, micro-batches and placement come from the file",
    )  # fmt: skip
    parser.add_argument(
        "--chunks", type=int, default=None, help="model chunks per rank (default: 2 if interleaved)"
    )
    mlp, gpt = MODEL_DEFAULTS["mlp"], MODEL_DEFAULTS["gpt"]
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="the MLP's width")
    parser.add_argument(
        "--layers", type=int,
        help=f"the MLP's Linear layers (default {mlp['layers']}) or the GPT's blocks ({gpt['layers']})",
    )  # fmt: skip
    parser.add_argument("--dim", type=int, default=defaults.dim, help="the GPT's width")
    parser.add_argument("--heads", type=int, default=defaults.heads, help="the GPT's attention heads")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="the GPT's tokens per sample")
    parser.add_argument("--dropout", type=float, default=defaults.dropout, help="the GPT's dropout")
    parser.add_argument(
        "--data", metavar="PATH",
        help="a text file or folder for the GPT (default: the Python standard library's own sources)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-every", type=int, default=defaults.eval_every, metavar="N",
        help="the GPT's validation loss every N steps, and after the last (0: only after the last)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-batches", type=int, default=defaults.eval_batches, metavar="N",
        help="held-out batches per validation",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int,
        help=f"samples per step (default {mlp['batch_size']} for mlp, {gpt['batch_size']} for gpt)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, help=f"training steps (default {mlp['steps']} for mlp, {gpt['steps']} for gpt)"
    )
    parser.add_argument(
        "--lr", type=float, help=f"Adam learning rate (default {mlp['lr']:g} for mlp, {gpt['lr']:g} for gpt)"
    )
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="seeds the weights, the data and dropout (default 0)"
    )
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout, help="seconds any blocking call may wait"
    )
    parser.add_argument(
        "--dp", type=int, default=defaults.dp, metavar="N",
        help="data-parallel replicas of the pipeline: the processes form a (dp, pp) mesh, pp = processes / N "
        "(default 1); each replica takes a contiguous shard of --batch-size, which stays the global batch",
    )  # fmt: skip
    parser.add_argument(
        "--data-parallel", default=defaults.data_parallel, choices=["fsdp", "ddp"],
        help="what keeps the replicas in step: fsdp (FSDP2, parameters and optimizer state sharded over "
        "the replicas; default) or ddp (full copies)",
    )  # fmt: skip
    parser.add_argument(
        "--clip-grad-norm", type=float, metavar="X",
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
    parser.add_argument("--trace", metavar="FILE", help="write the run's timeline as a Chrome trace (JSON)")
    parser.add_argument("--png", metavar="FILE", help="draw the predicted and measured timelines")
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save checkpoints in DIR (after the last step, at least)"
    )
    parser.add_argument(
        "--checkpoint-every", metavar="N", type=int, default=defaults.checkpoint_every,
        help="also save every N steps (default: only after the last step)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="continue from the newest complete checkpoint in --checkpoint-dir, with any number of stages "
        "(starts fresh, and says so, when there is none); with torchrun --max-restarts, a restarted group "
        "goes on from there",
    )  # fmt: skip
    parser.add_argument(
        "--losses", metavar="FILE",
        help='write the loss of every step this run did as JSON: {"first_step": s, "losses": [...]}',
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        config = TrainConfig.from_args(args)
        return _train_and_report(config, args)
    except (ValueError, comms.CommError, CheckpointError, CorpusError) as error:
        print(f"pipeclock train: error: {error}", file=sys.stderr, flush=True)
        return 2 if isinstance(error, ValueError) else 1
    finally:
        comms.shutdown()


def _train_and_report(config: TrainConfig, args: argparse.Namespace) -> int:
    rank, world = comms.init(timeout=config.timeout)
    if world > 1 and stopping.under_torchrun():
        stopping.report_before_stopping(rank, config.timeout)
    boss = rank == 0
    if boss:
        print(_headline(config, world), flush=True)
        if _restarts_share_a_store():
            print(_SHARED_STORE_WARNING, file=sys.stderr, flush=True)
    progress = Progress(config.steps, enabled=boss)
    result = train(config, on_step=progress, on_eval=progress.validation)
    progress.close()
    if not boss:
        return 0
    if args.losses:
        _write_losses(args.losses, result.first_step, result.losses)
    if not result.losses:
        print(f"nothing to train: the checkpoint is at step {result.first_step}, --steps is {config.steps}")
        print(f"final loss {result.final_loss:.6f} after {result.first_step} steps", flush=True)
        return 0
    table = schedule_table(config, world // config.dp)
    if result.validation:
        print("\n" + "\n".join(_validation_lines(result.validation, LanguageTask(config))))
    print("\n" + "\n".join(summary_lines(result.report, config.schedule, table, config.batch_size)))
    if args.trace:
        path = write_trace(result.report, args.trace)
        print(f"\ntrace written to {path} (open it in chrome://tracing or https://ui.perfetto.dev)")
    if args.png:
        path = draw_runs([(config.schedule, result.report, table)], args.png)
        print(f"timelines drawn to {path}")
    print(f"final loss {result.final_loss:.6f} after {config.steps} steps", flush=True)
    return 0


def _write_losses(path: str, first_step: int, losses: list[float]) -> None:
    """Exact values (JSON keeps a float's every digit), so runs can be compared bit for bit."""
    Path(path).write_text(json.dumps({"first_step": first_step, "losses": losses}) + "\n")


_SHARED_STORE_WARNING = (
    "pipeclock train: warning: torchrun keeps one store for every restart, so a restarted group can read "
    "the dead attempt's addresses and fail or hang (pytorch/pytorch#135712); launch with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to restart safely"
)


def _restarts_share_a_store() -> bool:
    """True under ``torchrun --max-restarts K`` (K > 0) with the store shared between attempts."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    return restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _validation_lines(validation: list[tuple[int, float]], task: LanguageTask) -> list[str]:
    """The validation curve, and the bigram byte model's figure on the same held-out bytes beside it."""
    lines = [f"validation ({len(task.validation)} held-out batches): " + task.corpus.summary()]
    lines += [
        f"  after {steps:5d} steps  {loss:.4f} nats/token  {task.readable(loss)}"
        for steps, loss in validation
    ]
    baseline, final = task.baseline_bits_per_byte(), bits_per_byte(validation[-1][1])
    lines.append(f"  bigram byte model (order 1, fitted on the training split): {baseline:.3f} bits/byte")
    if final < baseline:
        lines.append(f"  the GPT beats it by {baseline - final:.3f} bits/byte")
    else:
        lines.append(f"  the GPT is {final - baseline:.3f} bits/byte behind it: train longer")
    return lines


def _headline(config: TrainConfig, world: int) -> str:
    chunks = config.chunks_per_rank()
    per_mb = config.batch_size / config.microbatches
    model = f"ShardedMLP {config.layers} x {config.hidden}"
    if config.model == "gpt":
        model = f"GPT {config.layers} blocks x {config.dim} ({config.heads} heads, seq {config.seq_len})"
    replicas = f" x {config.dp} replicas ({config.data_parallel})" if config.dp > 1 else ""
    per_mb /= config.dp
    fitting = f", {config.dtype}" if config.dtype != "fp32" else ""
    fitting += f", recompute {config.recompute}" if config.recompute != "none" else ""
    return (
        f"pipeclock train: {config.schedule}, {world // config.dp} stage(s) x {chunks} chunk(s){replicas}, "
        f"{config.microbatches} micro-batches of ~{per_mb:g} samples, {model}, {config.steps} steps{fitting}"
    )
