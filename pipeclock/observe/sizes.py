"""Sizes as people write them: ``24GB`` (powers of 1000) and ``24GiB`` (powers of 1024), read and shown."""

from __future__ import annotations

import re

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"24GB"`` -> 24 * 10**9, ``"24GiB"`` -> 24 * 2**30, ``"512MB"``, ``"1.5TB"``; a unit is required."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size: write a number and a unit, like 24GB or 80GiB")
    number, unit = float(match.group(1)), match.group(2)
    if not unit:
        raise ValueError(f"{text!r} has no unit: write 24GB (10^9 bytes) or 24GiB (2^30 bytes)")
    if unit.upper() not in _UNITS:
        raise ValueError(
            f"unknown unit {unit!r} in {text!r}: use B, KB, MB, GB, TB (powers of 1000) "
            "or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    return round(number * _UNITS[unit.upper()])


def format_bytes(count: float, binary: bool = False, digits: int = 3) -> str:
    """``40 GB`` or ``37.3 GiB``: ``digits`` significant digits at most, in the largest unit below the
    size."""
    steps = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if binary else (
        ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)
    )  # fmt: skip
    for name, size in steps:
        if abs(count) >= size:
            value = count / size
            text = f"{value:.{digits}g}" if value < 1000 else f"{value:.0f}"
            return f"{text} {name}"
    return f"{count:.0f} B"
