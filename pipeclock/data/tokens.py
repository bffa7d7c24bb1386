"""A token dataset on disk, memory-mapped: a ``prepare``d folder, or nanoGPT's ``train.bin``/``val.bin``.

Nothing is read whole: each split is a list of shards mapped with ``numpy.memmap``, seen as one
concatenated token stream. Training batch k is ``size`` windows of ``seq_len + 1`` tokens at offsets drawn
from (seed, k) alone (windows cross document boundaries, as nanoGPT and torchtitan pack them), so a
resumed run sees the batches the uninterrupted one would have; ``rows`` picks a replica's samples of
that global batch, and only their bytes are read. Validation is fixed, non-overlapping windows spread
evenly over the validation split. Every window is checked against the vocabulary: a token out of range
is one error naming its shard and offset, never an index error inside an embedding.

nanoGPT's folders carry no vocabulary size but in an optional ``meta.pkl``; without one ``vocab_size``
is None and the model's vocabulary bounds the ids (``bound``), so a larger id is still caught.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pipeclock.data.prepare import FORMAT
from pipeclock.models.text import _mix

DTYPES = ("uint16", "uint32")
NANOGPT_FILES = {"train": "train.bin", "val": "val.bin"}

Batch = tuple[torch.Tensor, torch.Tensor]


class TokenDataError(ValueError):
    """A token folder that cannot be read as its description says, or a token outside the vocabulary."""


def is_token_folder(path: str | Path | None) -> bool:
    """Whether ``path`` is a token folder (``dataset.json``, or nanoGPT's ``train.bin`` and ``val.bin``)."""
    if not path:
        return False
    folder = Path(path)
    return (folder / "dataset.json").is_file() or all((folder / f).is_file() for f in NANOGPT_FILES.values())


class TokenStream:
    """One split: its shards as one stream of token ids."""

    def __init__(self, name: str, shards: Sequence[tuple[Path, int]], dtype: str, vocab_size: int | None):
        self.name, self.vocab_size = name, vocab_size
        self.paths = [path for path, count in shards if count > 0]
        self.maps = [
            np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(count,))
            for path, count in shards
            if count > 0
        ]
        self.starts = [0]
        for mapped in self.maps:
            self.starts.append(self.starts[-1] + mapped.size)

    def numel(self) -> int:
        return self.starts[-1]

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start + length`` of the stream as int64, read from the shards that hold them."""
        parts, position = [], start
        while position < start + length:
            shard = bisect.bisect_right(self.starts, position) - 1
            offset = position - self.starts[shard]
            part = self.maps[shard][offset : offset + start + length - position]
            self._check(part, shard, offset)
            parts.append(part)
            position += part.size
        return np.concatenate(parts).astype(np.int64)

    def _check(self, part: np.ndarray, shard: int, offset: int) -> None:
        if self.vocab_size is None or not part.size or int(part.max()) < self.vocab_size:
            return
        at = int(np.argmax(part >= self.vocab_size))
        raise TokenDataError(
            f"{self.paths[shard]}: token {int(part[at])} at offset {offset + at} is outside the "
            f"vocabulary of {self.vocab_size}"
        )

    def windows(self, offsets: torch.Tensor, seq_len: int) -> Batch:
        rows = [self.window(int(offset), seq_len + 1) for offset in offsets]
        stacked = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, seq_len + 1, dtype=torch.long)
        return stacked[:, :-1], stacked[:, 1:]


class TokenDataset:
    """A folder of tokens, with ``TextCorpus``'s interface: ``batch``, ``validation_batches``, ``summary``."""

    def __init__(self, folder: str | Path, token_dtype: str | None = None):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise TokenDataError(f"--data {folder}: no such folder")
        if (self.folder / "dataset.json").is_file():
            self._open_prepared(token_dtype)
        elif is_token_folder(self.folder):
            self._open_nanogpt(token_dtype or "uint16")
        else:
            raise TokenDataError(f"--data {folder}: neither dataset.json nor nanoGPT's train.bin and val.bin")
        self.train, self.validation = (
            TokenStream(split, self._shards[split], self.dtype, self.vocab_size) for split in ("train", "val")
        )
        self.unit = "tokens"

    def _open_prepared(self, token_dtype: str | None) -> None:
        path = self.folder / "dataset.json"
        text = path.read_bytes()
        try:
            meta = json.loads(text)
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, not {FORMAT!r}")
            self.dtype, self.vocab_size = meta["dtype"], int(meta["vocab_size"])
            splits = {split: meta["splits"][split] for split in ("train", "val")}
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise TokenDataError(f"{path}: not a dataset description prepare wrote ({error})") from None
        if self.dtype not in DTYPES:
            raise TokenDataError(f"{path}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if token_dtype is not None and token_dtype != self.dtype:
            raise TokenDataError(f"--token-dtype {token_dtype} does not match {path}'s dtype {self.dtype}")
        self.meta, self.sha256 = meta, hashlib.sha256(text).hexdigest()
        self.tokenizer = meta.get("tokenizer", {}).get("name", "unknown")
        self.tokenizer_path = meta.get("tokenizer", {}).get("path")  # "bytes" for bytes
        self.tokenizer_sha256 = meta.get("tokenizer", {}).get("sha256")  # "" for bytes
        self._shards = {split: self._checked(splits[split]["shards"]) for split in splits}
        val = splits["val"]
        self.validation_bytes = val.get("bytes") or None

    def _checked(self, shards: list[dict]) -> list[tuple[Path, int]]:
        """Each shard's path and token count, once its size is exactly that many tokens of ``dtype``."""
        found, size = [], np.dtype(self.dtype).itemsize
        for shard in shards:
            path, count = self.folder / shard["file"], int(shard["tokens"])
            if not path.is_file():
                raise TokenDataError(f"{path}: missing (dataset.json lists it with {count:,} tokens)")
            actual = path.stat().st_size
            if actual != count * size:
                cut = "cut short" if actual < count * size else "longer than dataset.json says"
                raise TokenDataError(
                    f"{path}: {actual:,} bytes, {cut}: dataset.json says {count:,} tokens of {self.dtype} "
                    f"({count * size:,} bytes)"
                )
            found.append((path, count))
        return found

    def _open_nanogpt(self, dtype: str) -> None:
        if dtype not in DTYPES:
            raise TokenDataError(f"--token-dtype {dtype} is not one of {', '.join(DTYPES)}")
        self.dtype, self.meta, self.validation_bytes = dtype, {}, None
        size, self._shards, identity = np.dtype(dtype).itemsize, {}, hashlib.sha256()
        for split, name in NANOGPT_FILES.items():
            path = self.folder / name
            actual = path.stat().st_size
            if actual % size:
                raise TokenDataError(
                    f"{path}: {actual:,} bytes is not a whole number of {dtype} tokens (cut short, or "
                    "another --token-dtype)"
                )
            self._shards[split] = [(path, actual // size)]
            identity.update(f"{name}:{actual}:".encode() + _ends(path))
        self.sha256 = identity.hexdigest()
        self.vocab_size = _meta_vocabulary(self.folder / "meta.pkl")
        self.tokenizer = "nanoGPT's (unknown)"
        self.tokenizer_path = self.tokenizer_sha256 = None

    def bound(self, vocab_size: int) -> None:
        """Check every token read against ``vocab_size`` (the model's) from now on."""
        self.train.vocab_size = self.validation.vocab_size = vocab_size

    def summary(self) -> str:
        vocabulary = f"{self.vocab_size:,}" if self.vocab_size else "unknown"
        return (
            f"tokens: {self.folder} ({self.tokenizer}, vocabulary {vocabulary}, {self.dtype}), "
            f"{self.train.numel():,} train and {self.validation.numel():,} validation tokens, "
            f"sha256 {self.sha256[:12]}"
        )

    @property
    def validation_bytes_per_token(self) -> float | None:
        """Text bytes per validation token, where the text's bytes are known (a prepared folder)."""
        if not self.validation_bytes or not self.validation.numel():
            return None
        return self.validation_bytes / self.validation.numel()

    def check_fits(self, seq_len: int) -> None:
        if seq_len < 1:
            raise TokenDataError(f"seq_len must be at least 1, got {seq_len}")
        for name, split in (("train", self.train), ("validation", self.validation)):
            if split.numel() < seq_len + 1:
                raise TokenDataError(
                    f"--data {self.folder}: its {name} split has {split.numel():,} tokens, seq_len {seq_len} "
                    f"needs {seq_len + 1}"
                    + (
                        " (prepare holds out whole documents: give it more of them, a file or a .jsonl line "
                        "each, or a larger --validation-fraction)"
                        if name == "validation"
                        else ""
                    )
                )

    def batch(self, step: int, size: int, seq_len: int, seed: int = 0, rows: slice = slice(None)) -> Batch:
        """Training batch ``step`` (its ``rows``): windows at offsets drawn from (seed, step) alone."""
        self.check_fits(seq_len)
        generator = torch.Generator().manual_seed(_mix(seed, step))
        last_start = self.train.numel() - (seq_len + 1)
        offsets = torch.randint(0, last_start + 1, (size,), generator=generator)
        return self.train.windows(offsets[rows], seq_len)

    def validation_batches(self, size: int, seq_len: int, max_batches: int) -> list[Batch]:
        """Fixed, non-overlapping validation windows evenly spread over the split, ``size`` per batch."""
        self.check_fits(seq_len)
        slots = self.validation.numel() // (seq_len + 1)
        count = min(max_batches, slots // size) * size or slots
        offsets = torch.arange(count) * slots // count * (seq_len + 1)
        inputs, targets = self.validation.windows(offsets, seq_len)
        return list(zip(inputs.split(size), targets.split(size), strict=True))


def _ends(path: Path, size: int = 1 << 16) -> bytes:
    """A file's first and last ``size`` bytes: enough to tell two datasets apart without reading either."""
    with open(path, "rb") as handle:
        head = handle.read(size)
        handle.seek(max(0, path.stat().st_size - size))
        return head + handle.read(size)


class _PlainData(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, strings, numbers): a ``meta.pkl`` runs no code."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def _meta_vocabulary(path: Path) -> int | None:
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as handle:
            meta = _PlainData(handle).load()
        return int(meta["vocab_size"])
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as error:
        raise TokenDataError(f"{path}: no plain vocab_size in it ({error})") from None
