"""What a run is asked to do (``TrainConfig``, with each model's defaults) and what it did
(``TrainResult``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from pipeclock.engine.actions import Schedule, num_chunks, placement_of
from pipeclock.engine.csv_schedule import load_csv
from pipeclock.engine.generators import chunks_of, generate, get_schedule, supports_chunks
from pipeclock.engine.orchestrator import StepRecord
from pipeclock.observe import run_log
from pipeclock.observe.metrics import RunReport
from pipeclock.training.balance import check_balance
from pipeclock.training.checks import check_values
from pipeclock.training.optimizer import parse_betas

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
