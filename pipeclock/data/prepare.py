"""``prepare``: documents to token shards and a ``dataset.json``, streamed, tokenized by worker processes.

The main process reads the inputs a batch of pieces at a time (``documents``), hands each batch to a
pool of workers (at most two batches per worker in flight, so memory stays bounded however large the
input), and appends the ids that come back, in order, to the open shard of the document's split, with
the end-of-text id after each document. A shard is closed at ``shard_tokens`` tokens and the next one
begun. ``dataset.json`` is written last: a folder without it is an unfinished preparation.

The validation split is whole documents chosen by a hash of the document's index, so the choice depends
on nothing but the index and the fraction (not on the workers or the order of completion).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from pipeclock.data import documents
from pipeclock.data.tokenizer import PrepareTokenizer

FORMAT = "pipeclock-tokens"
SPLITS = ("train", "val")
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
BATCH_BYTES = 1 << 20  # the text handed to a worker at a time


class PrepareError(ValueError):
    """Input that gives no dataset (no text at all) or an output folder that is not free."""


def dtype_for(vocab_size: int) -> str:
    """uint16 holds ids below 65,536; a larger vocabulary needs uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_validation(document: int, fraction: float) -> bool:
    """Whether document ``document`` is held out: its index's hash, uniform in [0, 1), below ``fraction``."""
    digest = hashlib.blake2b(str(document).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


class ShardWriter:
    """One split's shards, ``{split}_0000.bin`` on, appended to and closed at ``limit`` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: str, limit: int):
        self.directory, self.split, self.dtype, self.limit = directory, split, np.dtype(dtype), limit
        self.shards: list[dict] = []
        self.documents = self.bytes = 0
        self._file = None

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self._file is None or self.shards[-1]["tokens"] == self.limit:
                self._open_next()
            room = self.limit - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            self._file.write(part.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
            self.shards[-1]["tokens"] += int(part.size)

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):04d}.bin"
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 (open across writes, closed by close)
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def summary(self) -> dict:
        tokens = sum(shard["tokens"] for shard in self.shards)
        return {"documents": self.documents, "tokens": tokens, "bytes": self.bytes, "shards": self.shards}


def prepare(
    inputs: Sequence[str],
    output: str | Path,
    tokenizer: str = "bytes",
    field: str = "text",
    workers: int = 1,
    validation_fraction: float = 0.01,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = False,
) -> dict:
    """Prepare ``inputs`` into the folder ``output`` (new, or empty); the ``dataset.json`` written.

    On any error the folder is left as it was found (removed when this call made it).
    """
    if validation_fraction == 0.0:
        raise PrepareError(
            "--validation-fraction 0 holds out no document, and train --data needs a validation split: "
            "give a fraction above 0 (the default is 0.01)"
        )
    if not 0.0 < validation_fraction < 1.0:
        raise PrepareError(f"--validation-fraction must be in (0, 1), got {validation_fraction}")
    if workers < 1 or shard_tokens < 1:
        raise PrepareError(f"--workers must be at least 1, got {workers}")
    files = documents.input_files(inputs)
    named = [Path(given) for given in inputs if Path(given).is_file()]
    tok = PrepareTokenizer(tokenizer)
    folder = Path(output)
    made = _claim(folder)
    try:
        return _prepare(
            files, named, folder, tok, field, workers, validation_fraction, shard_tokens, progress
        )
    except BaseException:
        _release(folder, made)
        raise


def _prepare(files, named, folder, tok, field, workers, fraction, shard_tokens, progress) -> dict:
    dtype = dtype_for(tok.vocab_size)
    writers = {split: ShardWriter(folder, split, dtype, shard_tokens) for split in SPLITS}
    total = sum(path.stat().st_size for path in files)
    bar = _bar(total, progress)
    eot = np.array([tok.eot])
    for batch, (ids, sizes) in _tokenized(documents.pieces(files, field, named), tok, workers):
        for piece, piece_ids, size in zip(batch, ids, sizes, strict=True):
            writer = writers["val" if is_validation(piece.document, fraction) else "train"]
            writer.bytes += size
            writer.write(piece_ids)
            if piece.last:
                writer.write(eot)
                writer.documents += 1
            bar.update(size)
    bar.close()
    for writer in writers.values():
        writer.close()
    if sum(w.bytes for w in writers.values()) == 0:
        raise PrepareError(
            f"no text in {', '.join(str(p) for p in files) or 'the inputs'}: nothing to prepare"
        )
    dataset = {
        "format": FORMAT,
        "version": 1,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "eot": tok.eot,
        "tokenizer": tok.identity(),
        "validation_fraction": fraction,
        "splits": {split: writer.summary() for split, writer in writers.items()},
    }
    (folder / "dataset.json").write_text(json.dumps(dataset, indent=1) + "\n")
    return dataset


def _tokenized(source: Iterator, tok: PrepareTokenizer, workers: int) -> Iterator[tuple[list, tuple]]:
    """(pieces, their ids) per batch of about ``BATCH_BYTES`` of text, in input order."""
    batches = _batches(source)
    if workers == 1:
        for batch in batches:
            yield batch, tok.encode([piece.text for piece in batch])
        return
    context = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(tok.spec,)) as pool:
        waiting: deque = deque()
        for batch in batches:
            waiting.append((batch, pool.apply_async(_encode, ([piece.text for piece in batch],))))
            if len(waiting) >= 2 * workers:
                done, result = waiting.popleft()
                yield done, result.get()
        while waiting:
            done, result = waiting.popleft()
            yield done, result.get()
        pool.close()
        pool.join()


def _batches(source: Iterator) -> Iterator[list]:
    batch, size = [], 0
    for piece in source:
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


_worker_tokenizer: PrepareTokenizer | None = None


def _start_worker(spec: str) -> None:
    """A worker leaves Ctrl-C to the main process (which stops the pool) and dies quietly when stopped."""
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer = PrepareTokenizer(spec)


def _encode(texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
    return _worker_tokenizer.encode(texts)


def _claim(folder: Path) -> bool:
    """Make sure ``folder`` is new or empty (a preparation never mixes with other files); whether made."""
    if folder.exists() and not folder.is_dir():
        raise PrepareError(f"--output {folder}: exists and is not a folder")
    if folder.is_dir() and any(folder.iterdir()):
        raise PrepareError(
            f"--output {folder}: the folder is not empty (prepare writes into a new or empty one)"
        )
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    return made


def _release(folder: Path, made: bool) -> None:
    if made:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for child in folder.iterdir():
        child.unlink()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr)
