"""Real text for a byte-level GPT, with nothing to download.

A language model is only convincing on real text, but a course that must run offline cannot fetch a
dataset. Every machine that runs pipeclock already has one: the Python standard library's own source.
``TextCorpus.default()`` reads a fixed, sorted selection of it; ``TextCorpus.from_path`` reads any text
file or folder instead. Since the default depends on the interpreter's version, ``summary()`` prints the
corpus's size and SHA-256 so a run can say exactly what it trained on.

Tokens are bytes (``ByteTokenizer``): no vocabulary file, and bits per byte is the natural score. A
model that comes with its own tokenizer reads the same text as its tokens (``TextCorpus.tokenized``). The
score to beat is ``bigram_bits_per_byte``, a counted order-1 byte model: a GPT that cannot beat it has
learnt nothing a table of byte pairs could not.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

DEFAULT_CORPUS_BYTES = 2_000_000
VOCAB_SIZE = 256

Batch = tuple[torch.Tensor, torch.Tensor]


class CorpusError(ValueError):
    """A corpus that cannot be used: missing, empty, unreadable, or shorter than one sequence."""


class ByteTokenizer:
    """Text as its UTF-8 bytes: 256 symbols, every string encodable, nothing to train or download."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> torch.Tensor:
        """The int64 ids of ``text``'s UTF-8 bytes."""
        return _as_uint8(text.encode("utf-8")).long()

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of byte ids; a sampled id sequence may cut a character, so bad bytes become U+FFFD."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


class TextCorpus:
    """The bytes of a corpus as one uint8 tensor, split once into train and validation at a fixed byte.

    The last ``validation_fraction`` of the bytes is validation. Splitting at one position (not by
    sampling windows) means no training window ever overlaps a validation window.
    """

    def __init__(
        self, data: bytes, description: str, validation_fraction: float = 0.1, files: Sequence[str] = ()
    ):
        if not 0.0 < validation_fraction < 1.0:
            raise CorpusError(
                f"{description}: validation_fraction must be in (0, 1), got {validation_fraction}"
            )
        if not data:
            raise CorpusError(f"corpus {description} is empty")
        self.data = _as_uint8(data)
        self.unit = "bytes"  # what ``train`` and ``validation`` hold: bytes, or token ids (`tokenized`)
        self.validation_bytes_per_token = 1.0  # turns nats per token into bits per byte
        self.description = description
        self.files = tuple(files)
        self.sha256 = hashlib.sha256(data).hexdigest()
        split = self.num_bytes - round(self.num_bytes * validation_fraction)
        self.train, self.validation = self.data[:split], self.data[split:]

    @classmethod
    def from_path(cls, path: str | Path, validation_fraction: float = 0.1) -> TextCorpus:
        """A text file, or the text files under a folder in relative-path order (hidden, binary skipped)."""
        path = Path(path)
        if not path.exists():
            raise CorpusError(f"corpus path {path} does not exist")
        if path.is_dir():
            return cls._from_folder(path, validation_fraction)
        if not path.is_file():
            raise CorpusError(f"corpus path {path} is neither a file nor a folder")
        data = _read_text_bytes(path)
        if data is None:
            raise CorpusError(f"corpus file {path} is not a readable text file (unreadable or contains NUL)")
        return cls(data, str(path), validation_fraction, files=[path.name])

    @classmethod
    def _from_folder(cls, folder: Path, validation_fraction: float) -> TextCorpus:
        names, parts = [], []
        for relative in _visible_files(folder):
            data = _read_text_bytes(folder / relative)
            if data is not None:
                names.append(relative)
                parts.append(data)
        if not names:
            raise CorpusError(f"corpus folder {folder} has no readable text file (hidden and binary skipped)")
        description = f"{folder} ({_files(len(names))})"
        return cls(b"".join(parts), description, validation_fraction, files=names)

    @classmethod
    def default(cls, budget: int = DEFAULT_CORPUS_BYTES, validation_fraction: float = 0.1) -> TextCorpus:
        """The running interpreter's top-level stdlib ``*.py`` files, sorted by name, up to ``budget`` bytes.

        Whole files are taken in order while the total stays within the budget (always at least one), so
        the same interpreter always yields the same bytes.
        """
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        names, parts, total = [], [], 0
        for source in sorted(stdlib.glob("*.py"), key=lambda p: p.name):
            data = _read_text_bytes(source) if source.is_file() else None
            if data is None:
                continue
            if names and total + len(data) > budget:
                break
            names.append(source.name)
            parts.append(data)
            total += len(data)
        if not names:
            raise CorpusError(f"the standard library folder {stdlib} has no readable *.py file")
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        description = f"Python {version} standard library ({_files(len(names))})"
        return cls(b"".join(parts), description, validation_fraction, files=names)

    def tokenized(self, encode: Callable[[str], list[int]], name: str) -> TextCorpus:
        """The same corpus as token ids: each split's text (UTF-8, bad bytes as U+FFFD) through
        ``encode`` on its own, so no window crosses from train into validation. Batches are then windows
        of tokens; the bytes, the SHA-256 and the description stay the text's."""
        tokens = copy.copy(self)
        tokens.train, tokens.validation = (
            torch.tensor(encode(_text(split)), dtype=torch.int64) for split in (self.train, self.validation)
        )
        tokens.unit = f"{name} tokens"
        tokens.validation_bytes_per_token = self.validation.numel() / max(1, tokens.validation.numel())
        return tokens

    @property
    def num_bytes(self) -> int:
        return self.data.numel()

    def summary(self) -> str:
        """One line that pins down the corpus: what it is, its size, and (the start of) its SHA-256."""
        return f"corpus: {self.description}, {self.num_bytes:,} bytes, sha256 {self.sha256[:12]}"

    def check_fits(self, seq_len: int) -> None:
        """Fail before training when either split cannot hold one window of ``seq_len + 1`` bytes."""
        if seq_len < 1:
            raise CorpusError(f"seq_len must be at least 1, got {seq_len}")
        for name, split in (("train", self.train), ("validation", self.validation)):
            if split.numel() < seq_len + 1:
                raise CorpusError(
                    f"corpus {self.description} ({self.num_bytes:,} bytes) is shorter than one sequence: "
                    f"its {name} split has {split.numel():,} {self.unit}, seq_len {seq_len} needs "
                    f"{seq_len + 1}"
                )

    def batch(self, step: int, size: int, seq_len: int, seed: int = 0, rows: slice = slice(None)) -> Batch:
        """Training batch ``step``: ``size`` random train windows, drawn from (seed, step) alone (``rows``
        of them: a replica's share).

        Depending on nothing but (seed, step) makes batch k the same in every run, so a run resumed from a
        checkpoint at step k sees exactly the data the uninterrupted run would have.
        """
        self.check_fits(seq_len)
        generator = torch.Generator().manual_seed(_mix(seed, step))
        last_start = self.train.numel() - (seq_len + 1)
        offsets = torch.randint(0, last_start + 1, (size,), generator=generator)
        return _windows(self.train, offsets[rows], seq_len)

    def validation_batches(self, size: int, seq_len: int, max_batches: int) -> list[Batch]:
        """Fixed, non-overlapping validation windows, evenly spread over the split, ``size`` per batch.

        At most ``max_batches`` batches; fewer when the split is small, and when not even ``size``
        windows fit, one smaller batch of all that do.
        """
        self.check_fits(seq_len)
        if size < 1 or max_batches < 1:
            raise CorpusError(f"size and max_batches must be at least 1, got {size} and {max_batches}")
        slots = self.validation.numel() // (seq_len + 1)
        count = min(max_batches, slots // size) * size or slots
        chosen = torch.arange(count) * slots // count
        offsets = chosen * (seq_len + 1)
        inputs, targets = _windows(self.validation, offsets, seq_len)
        return list(zip(inputs.split(size), targets.split(size), strict=True))


def bigram_bits_per_byte(corpus: TextCorpus, batches: Sequence[Batch]) -> float:
    """Bits per byte of an add-one-smoothed bigram byte model fitted on the train split.

    It predicts ``targets[:, t]`` from ``inputs[:, t]`` alone, scored on exactly the targets of
    ``batches``: the baseline a GPT's validation bits per byte has to beat.
    """
    if not batches:
        raise ValueError("bigram_bits_per_byte needs at least one batch to score")
    train = corpus.train.long()
    pairs = train[:-1] * VOCAB_SIZE + train[1:]
    counts = torch.bincount(pairs, minlength=VOCAB_SIZE * VOCAB_SIZE).view(VOCAB_SIZE, VOCAB_SIZE)
    log_probs = torch.log_softmax(torch.log(counts.double() + 1.0), dim=1)
    previous = torch.cat([inputs.reshape(-1) for inputs, _ in batches]).long()
    following = torch.cat([targets.reshape(-1) for _, targets in batches]).long()
    return bits_per_byte(-log_probs[previous, following].mean().item())


def bits_per_byte(nats_per_token: float) -> float:
    """Nats per token as bits per byte: a byte-level token is one byte, so just divide by ln 2."""
    return nats_per_token / math.log(2)


def _windows(data: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> Batch:
    """(inputs, targets) of the ``seq_len + 1``-byte windows at ``offsets``: targets = inputs shifted."""
    windows = data[offsets.unsqueeze(1) + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step), distinct for distinct pairs (unlike ``seed * k + step``)."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _visible_files(folder: Path) -> list[str]:
    """The regular files under ``folder`` as sorted relative posix paths, hidden files and folders skipped."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            full = Path(root, name)
            if not name.startswith(".") and full.is_file():
                found.append(full.relative_to(folder).as_posix())
    return sorted(found)


def _read_text_bytes(path: Path) -> bytes | None:
    """The file's bytes, or None when it cannot be read or holds a NUL byte (taken to mean binary)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return None if b"\0" in data else data


def _files(count: int) -> str:
    return f"{count} file" if count == 1 else f"{count} files"


def _text(data: torch.Tensor) -> str:
    return bytes(data.numpy()).decode("utf-8", errors="replace")


def _as_uint8(data: bytes) -> torch.Tensor:
    """A uint8 tensor owning a copy of ``data`` (``frombuffer`` rejects an empty buffer)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
