"""Shared cases for the token-data tests: documents, a BPE tokenizer trained here, a prepared folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EOT_TEXT = "<|endoftext|>"


def documents(count: int = 40) -> list[str]:
    """Distinct documents of varied length, with non-ASCII text (so bytes and characters differ)."""
    words = ["pipeline", "stage", "micro-batch", "gradient", "bubble", "schedule", "rank", "tensor", "café"]
    return [
        " ".join(words[(i * 7 + j) % len(words)] for j in range(5 + (i * 13) % 40)) + f" doc {i}.\n"
        for i in range(count)
    ]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return path


def bpe_tokenizer(directory: Path, texts: list[str], vocab_size: int = 320) -> Path:
    """A real tokenizer directory: a byte-level BPE trained offline, saved by transformers, with
    ``<|endoftext|>`` as its eos token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT_TEXT).save_pretrained(str(directory))
    return directory


def split_tokens(folder: Path, split: str) -> np.ndarray:
    """A prepared split's tokens, its shards concatenated in dataset.json's order, read plainly."""
    meta = json.loads((folder / "dataset.json").read_text())
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    shards = meta["splits"][split]["shards"]
    return np.concatenate([np.fromfile(folder / s["file"], dtype=dtype) for s in shards] or [np.empty(0)])
