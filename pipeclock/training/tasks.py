"""What the main job trains: a model, its loss, its data, and how its validation is read.

``train`` knows nothing of MLPs or language models; a task gives it a rank's stage modules, the loss the
``Pipeline`` uses, batch k (from (seed, k) alone, so resume is exact) and, for a language model, the
held-out batches its validation loss is measured on.

- ``RegressionTask``: ``ShardedMLP`` on the synthetic regression (mean squared error).
- ``LanguageTask``: the GPT on real text, bytes as tokens, cross-entropy per token (nats); validation in
  bits per byte, beside an order-1 (bigram) byte model fitted on the same training split. On a token
  folder (``prepare``'s, or nanoGPT's ``train.bin``/``val.bin``) its vocabulary is the dataset's, padded
  to a multiple of 64 as nanoGPT pads GPT-2's (so tensor parallel can split it); validation is in nats
  per token, and in bits per byte where the folder records its text's bytes.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from pipeclock.data.tokens import TokenDataset, is_token_folder
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.placement import Placement
from pipeclock.models import gpt, mlp
from pipeclock.models.gpt import GPT, GPTConfig
from pipeclock.models.mlp import ShardedMLP
from pipeclock.models.partition import partition
from pipeclock.models.regression import SyntheticRegression
from pipeclock.models.text import VOCAB_SIZE, TextCorpus, bigram_bits_per_byte, bits_per_byte
from pipeclock.parallel.tensor_parallel import read_plan

GPT2_VOCABULARY = 50257  # what nanoGPT's own preparations write


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

    def batch(self, step: int, size: int, rows: slice = slice(None)):
        inputs, targets = self.data.batch(step, size)
        return inputs[rows], targets[rows]

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
        self.corpus = open_corpus(config)
        self.gpt = GPTConfig(
            vocab_size=gpt_vocabulary(self.corpus),
            dim=config.dim,
            layers=config.layers,
            heads=config.heads,
            seq_len=config.seq_len,
            dropout=config.dropout,
            seed=config.seed,
        )
        if isinstance(self.corpus, TokenDataset) and self.corpus.vocab_size is None:
            self.corpus.bound(self.gpt.vocab_size)  # a nanoGPT folder: the model's ids are the limit
        self.corpus.check_fits(config.seq_len)
        self.loss_fn = TokenCrossEntropy()
        self.validation = self.corpus.validation_batches(
            config.batch_size, config.seq_len, max(1, config.eval_batches)
        )

    def build(self, rank: int, world: int, placement: Placement, cut=None) -> list[nn.Module]:
        return GPT.for_rank(self.gpt, rank, world, len(placement.stages[rank]), placement, cut)

    def batch(self, step: int, size: int, rows: slice = slice(None)):
        """Batch ``step`` of ``size`` samples (its ``rows``: a replica reads only its own)."""
        return self.corpus.batch(step, size, self.config.seq_len, seed=self.config.seed, rows=rows)

    def tp_plan(self, tp: int, cut: list[range] | None, num_virtual: int) -> dict[str, str]:
        """``--tp-plan``'s plan, or the GPT's own; either way once ``tp`` is known to split its heads."""
        own = gpt.tp_plan(self.gpt, tp)
        return read_plan(self.config.tp_plan) if self.config.tp_plan else own

    def model_name(self) -> str:
        g = self.gpt
        return f"GPT {g.layers} blocks x {g.dim} ({g.heads} heads, seq {g.seq_len}, vocab {g.vocab_size})"

    def run_info(self) -> dict:
        info = {"model": "GPT", "gpt": self.gpt.as_dict(), "corpus_sha256": self.corpus.sha256}
        if isinstance(self.corpus, TokenDataset):  # what its ids mean: generate speaks bytes only
            info["tokens"] = self.corpus.tokenizer
        return info

    def baseline_bits_per_byte(self) -> float | None:
        """The order-1 byte model's bits per byte on the validation batches (what the GPT must beat);
        None on a token folder, whose bytes are not at hand."""
        if isinstance(self.corpus, TokenDataset):
            return None
        return bigram_bits_per_byte(self.corpus, self.validation)

    def bits_per_byte(self, loss: float) -> float | None:
        """A validation loss (nats per token) as bits per byte of text: over the validation text's bytes
        per token (1 for bytes); None where the text's bytes are not known (a nanoGPT folder)."""
        per_token = self.corpus.validation_bytes_per_token
        return None if per_token is None else bits_per_byte(loss / per_token)

    def readable(self, loss: float) -> str:
        per_byte = self.bits_per_byte(loss)
        return "" if per_byte is None else f"{per_byte:.3f} bits/byte"


def open_corpus(config) -> TextCorpus | TokenDataset:
    """``--data``'s text or tokens: a token folder memory-mapped, a text file or folder read, or the
    standard library's sources."""
    if is_token_folder(config.data):
        return TokenDataset(config.data, config.token_dtype)
    if config.token_dtype:
        raise ValueError(
            f"--token-dtype is for a folder of tokens (nanoGPT's train.bin and val.bin), not --data "
            f"{config.data}"
        )
    return TextCorpus.from_path(config.data) if config.data else TextCorpus.default()


def gpt_vocabulary(corpus: TextCorpus | TokenDataset) -> int:
    """The GPT's vocabulary: 256 bytes for text; a token folder's, padded up to a multiple of 64 (the
    padding ids never occur); for a nanoGPT folder without ``meta.pkl``, GPT-2's 50,257 so padded."""
    if not isinstance(corpus, TokenDataset):
        return VOCAB_SIZE
    return -(-(corpus.vocab_size or GPT2_VOCABULARY) // 64) * 64
