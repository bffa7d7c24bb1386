"""Is a checkpoint on disk still what was saved? Sizes and CRC32s recorded at save time, checked before use.

A checkpoint can be damaged after it was written: a disk that filled up, a copy cut short, a file edited
by hand. DCP would notice some of that deep inside a load, as an ``EOFError`` or an ``IndexError`` naming
no file, and would load a flipped bit without noticing at all. So a checkpoint carries its own manifest:
``pipeclock.json`` lists every other file of the directory with its size and CRC32 (``"files"``), and
two checks read it.

- The quick check reads no tensor: ``pipeclock.json`` parses and names the run; every listed file exists
  with its recorded size; ``.metadata`` loads with DCP's own reader, and every item it indexes lies
  inside its file. A cut-short ``.distcp`` or a garbled ``.metadata`` fails here, for the cost of a
  ``stat`` per file and two small reads. Choosing which checkpoint to resume from and which to keep use it.
- The full check adds the CRC32s, so it reads every byte once. A resume runs it on the checkpoint it is
  about to load, each rank summing a share of the files (``share``); export runs it whole.

CRC32 (``zlib.crc32``) detects accidental damage, which is all a checkpoint needs; it is no defence against
someone who rewrites the manifest on purpose. A checkpoint saved before the manifest existed has no
``"files"``: its sizes and sums go unchecked, the rest of the quick check still applies.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

RUN_FILE = "pipeclock.json"
METADATA = ".metadata"
_BLOCK = 1 << 20
_RUN_KEYS = ("step", "stages")


class Damaged(Exception):
    """What is wrong with a checkpoint: ``file`` and ``problem`` (``__1_0.distcp``, ``truncated to ...``)."""

    def __init__(self, file: str, problem: str):
        super().__init__(f"{file}: {problem}")
        self.file, self.problem = file, problem


# --- at save time ----------------------------------------------------------------------------------------


def manifest_files(directory: Path) -> list[str]:
    """The files a manifest covers: every file of the checkpoint but ``pipeclock.json``, sorted."""
    return sorted(path.name for path in directory.iterdir() if path.is_file() and path.name != RUN_FILE)


def share(names: Sequence[str], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` sums: every world-th, so each rank reads about as much."""
    return list(names[rank::world])


def describe_files(directory: Path, names: Sequence[str]) -> dict[str, dict[str, int]]:
    """``{name: {"bytes": size, "crc32": sum}}`` for the manifest."""
    return {
        name: {"bytes": (directory / name).stat().st_size, "crc32": crc32(directory / name)} for name in names
    }


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as file:
        while block := file.read(_BLOCK):
            value = zlib.crc32(block, value)
    return value


# --- before use ------------------------------------------------------------------------------------------


def read_run(directory: Path) -> dict:
    """``pipeclock.json``, or ``Damaged`` saying why it cannot be used."""
    try:
        run = json.loads((directory / RUN_FILE).read_text())
    except FileNotFoundError:
        raise Damaged(RUN_FILE, "missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise Damaged(RUN_FILE, f"not valid JSON, {error}") from None
    if not isinstance(run, dict) or any(key not in run for key in _RUN_KEYS):
        raise Damaged(RUN_FILE, f"not a pipeclock run description (no {' or '.join(_RUN_KEYS)})")
    return run


def quick_check(directory: Path, every_file_listed: bool = False) -> dict:
    """The run description, once ``pipeclock.json``, the file sizes and ``.metadata`` are sound.

    Raises ``Damaged`` for the first problem found; reads no tensor. With ``every_file_listed`` (a save
    about to be renamed), a file ``.metadata`` indexes must also be one the manifest lists.
    """
    run = read_run(directory)
    listed = run.get("files", {})
    for name, recorded in sorted(listed.items()):
        _check_size(directory / name, recorded["bytes"])
    indexed = _check_index(directory)
    unlisted = sorted(set(indexed) - set(listed))
    if every_file_listed and unlisted:
        raise Damaged(unlisted[0], f"indexed by {METADATA} but not in {RUN_FILE}'s file list")
    return run


def check_sums(directory: Path, run: dict, names: Sequence[str]) -> None:
    """``Damaged`` for the first of ``names`` whose CRC32 is not the recorded one."""
    listed = run.get("files", {})
    for name in names:
        if name in listed and crc32(directory / name) != listed[name]["crc32"]:
            raise Damaged(name, "its CRC32 differs from the one saved: the content changed")


def summed_files(run: dict) -> list[str]:
    """The files whose sums the manifest records, in the order ``share`` splits them."""
    return sorted(run.get("files", {}))


def _check_size(path: Path, recorded: int) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise Damaged(path.name, "missing") from None
    if size < recorded:
        raise Damaged(path.name, f"truncated to {size} of {recorded} bytes")
    if size > recorded:
        raise Damaged(path.name, f"{size} bytes where {recorded} were saved")


def _check_index(directory: Path) -> list[str]:
    """``.metadata`` loads, and each item it indexes ends inside its file (what a size alone may miss);
    the files it indexes."""
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except FileNotFoundError:
        raise Damaged(METADATA, "missing") from None
    except Exception as error:  # a pickle can fail in many ways; each means the file is unusable
        raise Damaged(METADATA, f"unreadable, {type(error).__name__}: {_first_line(error)}") from None
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.is_file():
            raise Damaged(name, "missing")
        if path.stat().st_size < end:
            raise Damaged(name, f"truncated to {path.stat().st_size} bytes, .metadata indexes {end}")
    return sorted(ends)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no detail"
