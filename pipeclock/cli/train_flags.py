"""The ``train`` command's flags, grouped as ``--help`` shows them, with the defaults of ``TrainConfig``."""

from __future__ import annotations

import argparse

from pipeclock.cli import config_file
from pipeclock.cli.arguments import (
    Parser,
    add_link_arguments,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
)
from pipeclock.engine.generators import SCHEDULES
from pipeclock.engine.precision import DTYPES
from pipeclock.engine.recompute import POLICY_HELP
from pipeclock.observe import run_log
from pipeclock.training.loop import MODEL_DEFAULTS, TrainConfig
from pipeclock.training.lr_schedule import SCHEDULES as LR_SCHEDULES
from pipeclock.training.optimizer import OPTIMIZERS, parse_betas


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
