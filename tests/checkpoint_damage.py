"""Ways to damage a saved checkpoint, as a disk, a crash or another program might, for the tests that
check every rank notices and names the file (``tests/test_checkpoint.py``)."""

from __future__ import annotations

from pathlib import Path


def flip_a_byte(path: Path, at: int = 1000) -> None:
    content = bytearray(path.read_bytes())
    content[at] ^= 0xFF
    path.write_bytes(bytes(content))


def garble(path: Path) -> None:
    """Overwrite the file with bytes that are no pickle, keeping its size."""
    size = path.stat().st_size
    path.write_bytes((b"\x80\x05garbage" * size)[:size])


def truncate(path: Path, size: int = 1000) -> None:
    with open(path, "r+b") as file:
        file.truncate(size)


def damages(step: Path) -> dict[str, tuple]:
    """Ways a saved checkpoint gets damaged, each with what export must say about it."""
    size = {path.name: path.stat().st_size for path in step.iterdir()}

    def cut_short(name: str) -> tuple:
        return lambda copy: truncate(copy / name), f"{name}: truncated to 1000 of {size[name]} bytes"

    return {
        "a .distcp cut short": cut_short("__1_0.distcp"),
        "a .distcp with a flipped byte": (
            lambda copy: flip_a_byte(copy / "__0_0.distcp"),
            "__0_0.distcp: its CRC32 differs from the one saved: the content changed",
        ),
        "a .distcp gone": (lambda copy: (copy / "__1_0.distcp").unlink(), "__1_0.distcp: missing"),
        "a .metadata cut short": cut_short(".metadata"),
        "a garbled .metadata of the right size": (
            lambda copy: garble(copy / ".metadata"),
            ".metadata: unreadable, UnpicklingError: ",
        ),
        "a corrupt pipeclock.json": (
            lambda copy: (copy / "pipeclock.json").write_text('{"step": 20, "stag'),
            "pipeclock.json: not valid JSON, Unterminated string starting at: line 1 column 14 (char 13)",
        ),
        "a pipeclock.json of something else": (
            lambda copy: (copy / "pipeclock.json").write_text("[1, 2]"),
            "pipeclock.json: not a pipeclock run description (no step or stages)",
        ),
    }
