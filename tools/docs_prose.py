"""The numbers a page's sentences state, held to the output the page quotes.

A ``value: NAME = REGEX`` note above a ``console`` block names a number of its output: the first
capture group of REGEX in the first output line where REGEX is found. The prose then cites it with an
HTML comment, invisible once the page is rendered, right before the number:

- ``<!--=NAME-->75.2`` states the value itself: the build writes the value printed there, and
  ``tests/test_docs.py`` fails when the prose and the quote disagree;
- ``<!--~NAME-->300 to 900`` (or ``300–900``) states bounds for a measured value (a timing, a measured
  bubble): the build and the docs test fail when a run prints a value outside them.

A page's names are its own; a name cited and never defined is a `PageError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARK = re.compile(r"<!--([=~])([\w-]+)-->")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]\d+)?")
_BOUNDS = re.compile(rf"({_NUMBER.pattern})(?:\s*(?:–|-|to)\s*)({_NUMBER.pattern})")
_FENCE = re.compile(r"^```", re.M)
_INLINE_CODE = re.compile(r"(`[^`\n]*`)")  # a citation shown as an example, not one made


@dataclass(frozen=True)
class Value:
    """A named number of a block's output, as printed."""

    name: str
    text: str
    where: str  # the block, for messages

    @property
    def number(self) -> float:
        return float(self.text.replace(",", ""))


def read_value_note(text: str) -> tuple[str, re.Pattern]:
    """``NAME = REGEX`` of a ``value:`` note; ValueError when it is not that."""
    name, equals, pattern = text.partition(" = ")
    if not equals or not re.fullmatch(r"[\w-]+", name.strip()):
        raise ValueError("write value: NAME = REGEX (REGEX with one group: the number)")
    compiled = re.compile(pattern.strip())
    if compiled.groups != 1:
        raise ValueError(f"value: {name.strip()}: REGEX needs exactly one group, the number")
    return name.strip(), compiled


def values_of(notes_values: list[tuple[str, re.Pattern]], lines: list[str], where: str) -> dict[str, Value]:
    """Each named value found in ``lines`` (the output a block quotes, or a run printed)."""
    found = {}
    for name, pattern in notes_values:
        match = next((m for m in map(pattern.search, lines) if m), None)
        if match is None or not _NUMBER.fullmatch(match.group(1)):
            raise ValueError(f"{where}: value {name}: {pattern.pattern!r} finds no number in the output")
        found[name] = Value(name, match.group(1), where)
    return found


def fill(text: str, values: dict[str, Value], page: str, rewrite: bool = False) -> tuple[str, list[str]]:
    """``text`` with every ``=`` citation stating its value, and the problems found: a number the prose
    cites that the output does not give (unless ``rewrite``: the build writes the run's value), a
    measured value outside the bounds the prose states."""
    problems: list[str] = []
    pieces = _FENCE.split(text)
    fences = _FENCE.findall(text)
    for index in range(0, len(pieces), 2):
        spans = _INLINE_CODE.split(pieces[index])
        spans[::2] = [_fill_prose(span, values, page, problems, rewrite) for span in spans[::2]]
        pieces[index] = "".join(spans)
    out = pieces[0]
    for fence, piece in zip(fences, pieces[1:], strict=True):
        out += fence + piece
    return out, problems


def _fill_prose(prose: str, values: dict[str, Value], page: str, problems: list[str], rewrite: bool) -> str:
    out, cursor = [], 0
    for match in MARK.finditer(prose):
        kind, name = match.group(1), match.group(2)
        if name not in values:
            raise ValueError(f"{page}: the prose cites {name}, which no value: note of the page defines")
        value, after = values[name], match.end()
        out.append(prose[cursor:after])
        cursor = after
        if kind == "=":
            stated = _NUMBER.match(prose, after)
            if stated is None:
                problems.append(f"{page}: <!--={name}--> is not followed by a number")
                continue
            if stated.group(0) != value.text and not rewrite:
                problems.append(
                    f"{page}: the prose says {name} is {stated.group(0)}; {value.where} prints {value.text}"
                )
            out.append(value.text)
            cursor = stated.end()
            continue
        bounds = _BOUNDS.match(prose, after)
        if bounds is None:
            problems.append(f"{page}: <!--~{name}--> is not followed by bounds (A to B, or A–B)")
            continue
        low, high = (float(group.replace(",", "")) for group in bounds.groups())
        if not low <= value.number <= high:
            problems.append(
                f"{page}: the prose bounds {name} to {bounds.group(0)}; {value.where} prints {value.text}"
            )
    out.append(prose[cursor:])
    return "".join(out)
