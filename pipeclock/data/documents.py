"""The documents of ``prepare``'s inputs, streamed: never more than one piece of text in memory.

- a ``.jsonl`` file: one document per non-blank line, the string in its ``field``;
- a ``.parquet`` file: one document per row of its ``field`` column (pyarrow, read a batch of rows at
  a time; imported only for such a file);
- any other file: one document, its text (UTF-8, bad bytes as U+FFFD), read in pieces of about
  ``PIECE_BYTES`` cut after a newline, so that one huge file never sits in memory whole;
- a folder: the files under it in relative-path order, hidden ones skipped, and binary ones (holding a
  NUL byte in their first piece) too.

Each piece comes as a ``Piece``: the document's index (0, 1, ... over all inputs), its text, and whether
it is the document's last piece (where the end-of-text separator follows).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PIECE_BYTES = 1 << 20


class InputError(ValueError):
    """An input that cannot be read as documents: missing, malformed, or without the field."""


@dataclass(frozen=True)
class Piece:
    document: int
    text: str
    last: bool


def input_files(inputs: Sequence[str]) -> list[Path]:
    """Every file the inputs name, folders expanded in order; a missing input is refused."""
    files = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            files += [path / name for name in _visible_files(path)]
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"input {given}: no such file or folder")
    return files


def pieces(files: Sequence[Path], field: str, named: Sequence[Path] = ()) -> Iterator[Piece]:
    """The documents of ``files`` as pieces, numbered in order. A binary file in a folder is skipped; one
    named on the command line (in ``named``) is refused."""
    index = 0
    for path in files:
        for text, last in _file_pieces(path, field, path in named):
            yield Piece(index, text, last)
            index += last


def _file_pieces(path: Path, field: str, named: bool) -> Iterator[tuple[str, bool]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from ((text, True) for text in _jsonl(path, field))
    elif suffix == ".parquet":
        yield from ((text, True) for text in _parquet(path, field))
    else:
        yield from _text(path, named)


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{number}: not a JSON object ({error.msg})") from None
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                found = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                found = found or "nothing"
                raise InputError(
                    f"{path}:{number}: no string field {field!r} (found: {found}; --field names it)"
                )
            yield value


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading .parquet needs pyarrow (pip install 'pipeclock[train]')") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's own error types: a file that is not parquet
        raise InputError(f"{path}: not a readable parquet file ({error})") from None
    if field not in table.schema_arrow.names:
        found = ", ".join(table.schema_arrow.names)
        raise InputError(f"{path}: no column {field!r} (found: {found}; --field names it)")
    for batch in table.iter_batches(batch_size=1024, columns=[field]):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield str(value)


def _text(path: Path, named: bool) -> Iterator[tuple[str, bool]]:
    """A text file in pieces cut after a newline (or at ``PIECE_BYTES`` in a line that long)."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 (a generator: the with below closes it)
    except OSError as error:
        raise InputError(f"input {path}: cannot be read ({error.strerror})") from None
    with handle:
        piece = handle.read(PIECE_BYTES)
        if b"\0" in piece:
            if named:
                raise InputError(f"input {path}: a binary file (it holds NUL bytes), not text")
            return
        while True:
            piece += handle.readline(PIECE_BYTES) if piece and not piece.endswith(b"\n") else b""
            following = handle.read(PIECE_BYTES)
            yield piece.decode("utf-8", errors="replace"), not following
            if not following:
                return
            piece = following


def _visible_files(folder: Path) -> list[str]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [
            Path(root, name).relative_to(folder).as_posix()
            for name in names
            if not name.startswith(".") and Path(root, name).is_file()
        ]
    return sorted(found)
