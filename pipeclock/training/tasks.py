"""What the main job trains: a model, its loss, its data, and how its validation is read.

``train`` knows nothing of MLPs or language models; a task gives it a rank's stage modules, the loss the
``Pipeline`` uses, batch k (from (seed, k) alone, so resume is exact) and, for a language model, the
held-out batches its validation loss is measured on.

- ``RegressionTask``: ``ShardedMLP`` on the synthetic regression (mean squared error).
- ``LanguageTask``: the GPT on real text, bytes as tokens, cross-entropy per token (nats); validation in
  bits per byte, beside an order-1 (bigram) byte model fitted on the same training split.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.placement import Placement
from pipeclock.models import gpt, mlp
from pipeclock.models.gpt import GPT, GPTConfig
from pipeclock.models.mlp import ShardedMLP
from pipeclock.models.partition import partition
from pipeclock.models.regression import SyntheticRegression
from pipeclock.models.text import TextCorpus, bigram_bits_per_byte, bits_per_byte
from pipeclock.parallel.tensor_parallel import read_plan


class RegressionTask:
    """``ShardedMLP`` (``layers`` x ``hidden``) learning the synthetic regression."""

    loss_fn = staticmethod(F.mse_loss)
    validation: tuple = ()  # no held-out batches: the regression is measured by its training loss

    def __init__(self, config):
        self.config = config
        self.data = SyntheticRegression(config.hidden, seed=config.seed)

    def build(self, rank: int, world: int, placement: Placement, cut=None) -> list[nn.Module]:
        c = self.config
        return ShardedMLP.for_rank(
            c.hidden, c.layers, rank, world, len(placement.stages[rank]), c.seed, placement, cut
        )

    def batch(self, step: int, size: int):
        return self.data.batch(step, size)

    def tp_plan(self, tp: int, cut: list[range] | None, num_virtual: int) -> dict[str, str]:
        """The tensor-parallel plan for the model cut into ``num_virtual`` stages (``cut``, or by count):
        ``--tp-plan``'s, or the MLP's own pairs within each stage."""
        c = self.config
        if c.tp_plan:
            return read_plan(c.tp_plan)
        return mlp.tp_plan(c.hidden, cut or partition(c.layers, num_virtual), tp)

    def model_name(self) -> str:
        return f"ShardedMLP {self.config.layers} x {self.config.hidden}"

    def run_info(self) -> dict:
        c = self.config
        return {"model": "ShardedMLP", "hidden": c.hidden, "layers": c.layers, "seed": c.seed}


class LanguageTask:
    """The GPT on a text corpus (``--data``, or the default: the Python standard library's sources)."""

    def __init__(self, config):
        self.config = config
        self.gpt = GPTConfig(
            dim=config.dim,
            layers=config.layers,
            heads=config.heads,
            seq_len=config.seq_len,
            dropout=config.dropout,
            seed=config.seed,
        )
        self.corpus = TextCorpus.from_path(config.data) if config.data else TextCorpus.default()
        self.corpus.check_fits(config.seq_len)
        self.loss_fn = TokenCrossEntropy()
        self.validation = self.corpus.validation_batches(
            config.batch_size, config.seq_len, max(1, config.eval_batches)
        )

    def build(self, rank: int, world: int, placement: Placement, cut=None) -> list[nn.Module]:
        return GPT.for_rank(self.gpt, rank, world, len(placement.stages[rank]), placement, cut)

    def batch(self, step: int, size: int):
        return self.corpus.batch(step, size, self.config.seq_len, seed=self.config.seed)

    def tp_plan(self, tp: int, cut: list[range] | None, num_virtual: int) -> dict[str, str]:
        """``--tp-plan``'s plan, or the GPT's own; either way once ``tp`` is known to split its heads."""
        own = gpt.tp_plan(self.gpt, tp)
        return read_plan(self.config.tp_plan) if self.config.tp_plan else own

    def model_name(self) -> str:
        g = self.gpt
        return f"GPT {g.layers} blocks x {g.dim} ({g.heads} heads, seq {g.seq_len}, vocab {g.vocab_size})"

    def run_info(self) -> dict:
        return {"model": "GPT", "gpt": self.gpt.as_dict(), "corpus_sha256": self.corpus.sha256}

    def baseline_bits_per_byte(self) -> float:
        """The order-1 byte model's bits per byte on the validation batches (what the GPT must beat)."""
        return bigram_bits_per_byte(self.corpus, self.validation)

    def bits_per_byte(self, loss: float) -> float:
        """A validation loss (nats per token) as bits per byte of text: a byte is a token here."""
        return bits_per_byte(loss)

    def readable(self, loss: float) -> str:
        return f"{self.bits_per_byte(loss):.3f} bits/byte"
