"""The course pages in ``docs/`` quote real commands, their real output, and the figures they draw.

This module reads those quotes, runs the commands (``tools.docs_run``), refreshes the quoted output and
copies the figures into ``docs/figures/`` (``python -m pipeclock docs``, ``make docs``);
``tests/test_docs.py`` uses the same reading and matching to check that the pages still say what the
code prints.

The convention, for whoever writes a page:

- A fenced block whose info string is ``console`` holds one command and its output. Its first line is
  ``$ `` and the command, run from the repository root; ``python`` and ``torchrun`` are the virtual
  environment's, and leading ``NAME=value`` words set environment variables. Every other line is the
  output: what the command prints on standard output.
- The quoted output is the whole output, except where a line ``...`` says lines were left out. So the
  quoted lines between two ``...`` must appear together and in that order, and without a leading (or
  trailing) ``...`` the quote starts at the first (or ends at the last) line printed.
- A quoted line matches a printed line when their words (split on white space) are the same. Numbers
  are words: they must be what the code prints today, except that a number with a decimal point may
  differ by 1 % (``FLOAT_TOLERANCE``): another CPU's kernels add in another order, and a loss after a
  hundred steps moves in its fourth digit.
- An HTML comment ``<!-- docs`` ... ``-->`` on the lines just above the block changes that, one note
  per line:

  ``vary: REGEX``
      Lines in which REGEX is found carry measurements (timings, shares of a measured step). In them,
      numbers with a decimal point or a thousands separator, numbers followed by ``%``, by ``x)`` (a
      ratio) or by a rate (``samples/s``: a busy machine's 50 has no separator) may differ, except
      right after ``= `` (the value of a formula). Everything else (counts, sizes) must match.
      Training losses go here too: their trajectory depends on the CPU's kernels.
  ``any: REGEX``
      Lines in which REGEX is found stand for any printed line in which REGEX finds the same text (e.g.
      ``^rank \\d \\|`` for a chart of a measured step).
  ``long: REASON``
      The command takes long; the docs test skips it, giving REASON (``PIPECLOCK_DOCS_LONG=1`` runs it).
  ``figure: FILE -> NAME``
      The command draws FILE; the build copies it to ``docs/figures/NAME``.
  ``exit: N``
      The command ends with exit code N, not 0 (``lab N --check`` on a loop with a fault).
  ``value: NAME = REGEX``
      Names a number of the output (REGEX's one group) for the prose to cite: ``<!--=NAME-->75.2``
      states it and is rewritten by the build; ``<!--~NAME-->300 to 900`` bounds a measured one, and a
      run outside the bounds fails (``tools/docs_prose.py``).

- A block that quotes no output yet is given the command's whole output by the next build; trim it with
  ``...`` afterwards.
- Between ``<!-- generated: KIND key=value ... -->`` and ``<!-- end generated -->`` a page holds a table
  made from the simulator (``tools/docs_tables.py``); the build rewrites it.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tools.docs_prose import Value, fill, read_value_note, values_of
from tools.docs_run import REPOSITORY, SIMULATOR, Ran, run_command, run_here, runs_here
from tools.docs_tables import refresh_generated

DOCS = REPOSITORY / "docs"
OMITTED = "..."

_NOTE_KEYS = ("vary", "any", "long", "figure", "exit", "value")
# A measured number: thousands separators, a decimal point, or a percent sign; not the value of a formula.
_MEASURED = re.compile(
    r"(?<![\w.,])(?<!= )(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+(?=%|x\)|/s| samples/s| tokens/s))"
)


# --- reading pages ----------------------------------------------------------------------------------


@dataclass
class Notes:
    """What the ``<!-- docs ... -->`` comment above a block says about it."""

    vary: list[re.Pattern] = field(default_factory=list)
    any: list[re.Pattern] = field(default_factory=list)
    long: str | None = None
    figures: list[tuple[str, str]] = field(default_factory=list)  # (drawn by the command, name in figures/)
    exit: int = 0  # the exit code the command ends with (a check that finds a fault says so with 1)
    values: list[tuple[str, re.Pattern]] = field(default_factory=list)  # numbers the prose cites


@dataclass
class Block:
    """One ``console`` block: a command and the output its page quotes."""

    page: Path
    line: int  # 1-based line of the command, for messages
    command: str
    output: list[str]
    notes: Notes
    first: int  # index (0-based) of the first output line in the page's lines
    end: int  # index of the closing fence

    def __str__(self) -> str:
        return f"{_shown(self.page)}:{self.line}: $ {self.command}"

    @property
    def simulator_only(self) -> bool:
        return self.command.startswith(SIMULATOR)

    @property
    def runs_here(self) -> bool:
        """Whether `run_here` runs it (`runs_here`)."""
        return runs_here(self.command)


class PageError(ValueError):
    """A page breaks the convention (a note without a block, a block without a command...)."""


def read_blocks(page: Path, text: str | None = None) -> list[Block]:
    """Every ``console`` block of ``page`` (or of ``text``, the page's new text), in order, with its notes."""
    lines = (page.read_text() if text is None else text).splitlines()
    blocks, notes, index = [], None, 0
    while index < len(lines):
        line = lines[index]
        if line.strip() == "<!-- docs":
            notes, index = _read_notes(page, lines, index)
            continue
        if line.startswith("```"):
            end = _closing_fence(page, lines, index)
            if line.strip() == "```console":
                blocks.append(_block(page, lines, index, end, notes or Notes()))
            elif notes is not None:
                raise PageError(
                    f"{_shown(page)}:{index + 1}: a docs note must sit right above a console block"
                )
            notes, index = None, end + 1
            continue
        if notes is not None and line.strip():
            raise PageError(f"{_shown(page)}:{index + 1}: a docs note must sit right above a console block")
        index += 1
    return blocks


def _read_notes(page: Path, lines: list[str], start: int) -> tuple[Notes, int]:
    notes, index = Notes(), start + 1
    while index < len(lines) and lines[index].strip() != "-->":
        key, _, value = lines[index].strip().partition(": ")
        if key not in _NOTE_KEYS or not value:
            raise PageError(
                f"{_shown(page)}:{index + 1}: a docs note is one of {', '.join(_NOTE_KEYS)}: VALUE"
            )
        if key == "figure":
            drawn, arrow, name = value.partition(" -> ")
            if not arrow:
                raise PageError(f"{_shown(page)}:{index + 1}: write figure: FILE -> NAME")
            notes.figures.append((drawn.strip(), name.strip()))
        elif key == "long":
            notes.long = value
        elif key == "exit":
            notes.exit = int(value)
        elif key == "value":
            try:
                notes.values.append(read_value_note(value))
            except (ValueError, re.error) as error:
                raise PageError(f"{_shown(page)}:{index + 1}: {error}") from None
        else:
            getattr(notes, key).append(re.compile(value))
        index += 1
    return notes, index + 1


def _closing_fence(page: Path, lines: list[str], start: int) -> int:
    for index in range(start + 1, len(lines)):
        if lines[index].startswith("```"):
            return index
    raise PageError(f"{_shown(page)}:{start + 1}: a code block that never closes")


def _block(page: Path, lines: list[str], fence: int, end: int, notes: Notes) -> Block:
    if end == fence + 1 or not lines[fence + 1].startswith("$ "):
        raise PageError(f"{_shown(page)}:{fence + 2}: a console block starts with '$ ' and its command")
    command = lines[fence + 1][2:].strip()
    return Block(page, fence + 2, command, lines[fence + 2 : end], notes, fence + 2, end)


# --- matching quoted output with printed output -------------------------------------------------------


def line_matches(quoted: str, printed: str, notes: Notes) -> bool:
    """Whether ``printed`` is a line the page may show as ``quoted`` (see the module's convention)."""
    for pattern in notes.any:
        found = pattern.search(quoted)
        if found:
            other = pattern.search(printed)
            return other is not None and other.group(0) == found.group(0)
    if any(pattern.search(quoted) for pattern in notes.vary):
        quoted, printed = _MEASURED.sub("#", quoted), _MEASURED.sub("#", printed)
    return _words_match(quoted.split(), printed.split())


FLOAT_TOLERANCE = 0.01
_DECIMAL = re.compile(r"^([^\d-]*)(-?\d+\.\d+)([^\d]*)$")


def _words_match(quoted: list[str], printed: list[str]) -> bool:
    return len(quoted) == len(printed) and all(map(_word_matches, quoted, printed))


def _word_matches(quoted: str, printed: str) -> bool:
    """The same word, or the same decimal number to ``FLOAT_TOLERANCE`` with the same text around it."""
    if quoted == printed:
        return True
    a, b = _DECIMAL.match(quoted), _DECIMAL.match(printed)
    if not (a and b) or (a.group(1), a.group(3)) != (b.group(1), b.group(3)):
        return False
    x, y = float(a.group(2)), float(b.group(2))
    return abs(x - y) <= FLOAT_TOLERANCE * max(abs(x), abs(y))


class Mismatch(AssertionError):
    """The quoted output is not what the command printed."""


def matched_lines(quoted: list[str], printed: list[str], notes: Notes) -> list[str]:
    """The printed lines the quote stands for, one per quoted line (``...`` kept); `Mismatch` if none."""
    segments = _segments(quoted)
    cursor, shown = 0, []
    for number, (gap_before, lines) in enumerate(segments):
        last = number == len(segments) - 1
        ends_at_end = last and (not quoted or quoted[-1].strip() != OMITTED)
        starts = range(cursor, len(printed) - len(lines) + 1) if gap_before else range(cursor, cursor + 1)
        if ends_at_end:
            starts = [start for start in starts if start + len(lines) == len(printed)]
        found = next((s for s in starts if _segment_matches(lines, printed, s, notes)), None)
        if found is None:
            raise Mismatch(_explain(lines, printed, list(starts), notes))
        if gap_before:
            shown.append(OMITTED)
        shown += printed[found : found + len(lines)]
        cursor = found + len(lines)
    if quoted and quoted[-1].strip() == OMITTED:
        shown.append(OMITTED)
    return shown


def _segments(quoted: list[str]) -> list[tuple[bool, list[str]]]:
    """The quote cut at its ``...`` lines: (whether lines were left out before, the lines)."""
    segments: list[tuple[bool, list[str]]] = [(False, [])]
    for line in quoted:
        if line.strip() == OMITTED:
            segments.append((True, []))
        else:
            segments[-1][1].append(line)
    return [segment for segment in segments if segment[1]] or [(False, [])]


def _segment_matches(lines: list[str], printed: list[str], start: int, notes: Notes) -> bool:
    return start + len(lines) <= len(printed) and all(
        line_matches(line, printed[start + k], notes) for k, line in enumerate(lines)
    )


def _explain(lines: list[str], printed: list[str], starts: list[int], notes: Notes) -> str:
    """Where the quote comes closest to the output, and the first line that differs there."""

    def agreeing(start: int) -> int:
        count = 0
        while count < len(lines) and _segment_matches(
            lines[count : count + 1], printed, start + count, notes
        ):
            count += 1
        return count

    if not starts:
        return f"the quoted lines starting {lines[0]!r} cannot be placed in the {len(printed)} lines printed"
    best = max(starts, key=agreeing)
    wrong = agreeing(best)
    there = printed[best + wrong] if best + wrong < len(printed) else "(end of output)"
    return f"quoted   {lines[wrong]!r}\nprinted  {there!r}"


def page_values(blocks: list[Block], printed: dict[int, list[str]] | None = None) -> dict[str, Value]:
    """The numbers the blocks' ``value:`` notes name, read from the quoted output (or, for a block whose
    index is in ``printed``, from what its command printed)."""
    found: dict[str, Value] = {}
    for index, block in enumerate(blocks):
        lines = (printed or {}).get(index, block.output)
        try:
            found.update(values_of(block.notes.values, lines, str(block)))
        except ValueError as error:
            raise PageError(str(error)) from None
    return found


def prose_problems(
    page: Path, text: str | None = None, printed: dict[int, list[str]] | None = None, rewrite: bool = False
) -> tuple[str, list[str]]:
    """The page's text (or ``text``) with its prose's numbers filled from its quotes (or from ``printed``,
    what some of its blocks' commands printed, by block index), and where the prose and the output
    disagree (unless ``rewrite``, as the build does) or a measured value leaves the bounds the prose
    states (`tools.docs_prose`)."""
    text = page.read_text() if text is None else text
    try:
        return fill(text, page_values(read_blocks(page, text), printed), _shown(page), rewrite)
    except ValueError as error:
        raise PageError(str(error)) from None


def bounds_problems(block: Block, printed: list[str]) -> list[str]:
    """Where what ``block``'s command printed leaves the bounds the page's prose gives its values (a
    varying line may differ from its quote: only the bounds hold a new run)."""
    index = next(k for k, other in enumerate(read_blocks(block.page)) if other.line == block.line)
    _, problems = prose_problems(block.page, printed={index: printed})
    return [problem for problem in problems if "the prose bounds" in problem]


def check(block: Block, ran: Ran) -> list[str]:
    """The printed lines the page should quote for ``block``; raises `Mismatch` if the quote is wrong."""
    if ran.returncode != block.notes.exit:
        raise Mismatch(f"exit code {ran.returncode}\n{ran.stdout[-2000:]}{ran.stderr[-2000:]}")
    if not block.output:
        return ran.lines
    return matched_lines(block.output, ran.lines, block.notes)


# --- the build ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    block: Block | None  # None for a sentence of the prose
    seconds: float = 0.0
    refreshed: list[str] = field(default_factory=list)  # the output lines the page should quote
    figures: list[Path] = field(default_factory=list)
    problem: str | None = None
    prose: bool = False  # a sentence's number, not a command's output


def pages(docs: Path = DOCS, names: list[str] | None = None) -> list[Path]:
    """The pages in ``docs``; with ``names`` (``lab5-gpipe`` or ``lab5-gpipe.md``), only those."""
    every = sorted(docs.glob("*.md"))
    if not names:
        return every
    wanted = {name if name.endswith(".md") else f"{name}.md" for name in names}
    unknown = sorted(wanted - {page.name for page in every})
    if unknown:
        raise PageError(f"no page {', '.join(unknown)} in {_shown(docs)}")
    return [page for page in every if page.name in wanted]


def build(
    docs: Path = DOCS, quick: bool = False, say: Callable[[str], None] = print, only: list[str] | None = None
) -> list[Outcome]:
    """Run every quoted command (with ``quick``, only the simulator's), refresh the quoted outputs and
    the generated tables, and draw every figure the pages show afresh into ``docs/figures``. ``only``
    names the pages to rebuild (all by default): redrawing one lab's figures need not rerun the others'."""
    (docs / "figures").mkdir(parents=True, exist_ok=True)
    outcomes = []
    for page in pages(docs, only):
        original = page.read_text()
        blocks = [block for block in read_blocks(page) if block.simulator_only or not quick]
        if not blocks and "<!-- generated:" not in original:
            continue  # a page with nothing to rebuild is never rewritten
        done = [_build_block(block, docs / "figures") for block in blocks]
        for outcome in done:
            say(_describe(outcome))
        lines = original.splitlines()
        for outcome in reversed(done):  # from the bottom, so the blocks above keep their line numbers
            if outcome.problem is None:
                lines[outcome.block.first : outcome.block.end] = outcome.refreshed
        text, problems = prose_problems(page, refresh_generated("\n".join(lines) + "\n"), rewrite=True)
        if text != original:
            page.write_text(text)
        for problem in problems:
            say(f"{_shown(page)}  FAILED\n    {problem}")
        outcomes += done + [Outcome(None, problem=problem, prose=True) for problem in problems]
    return outcomes


def _build_block(block: Block, figures: Path) -> Outcome:
    outcome = Outcome(block)
    for drawn, _ in block.notes.figures:  # so that a figure the command no longer draws is noticed;
        (REPOSITORY / drawn).unlink(missing_ok=True)  # the page's copy is replaced only by a good run
    ran = run_here(block.command) if block.runs_here else run_command(block.command)
    outcome.seconds = ran.seconds
    try:
        outcome.refreshed = check(block, ran)
    except Mismatch as mismatch:
        outcome.problem = str(mismatch)
        return outcome
    for drawn, name in block.notes.figures:
        if not (REPOSITORY / drawn).is_file():
            outcome.problem = f"the command did not draw {drawn}"
            return outcome
        outcome.figures.append(Path(shutil.copyfile(REPOSITORY / drawn, figures / name)))
    return outcome


def _describe(outcome: Outcome) -> str:
    drawn = "".join(f"\n    drew {_shown(path)}" for path in outcome.figures)
    if outcome.problem is None:
        return f"{outcome.block}  ({outcome.seconds:.1f} s){drawn}"
    problem = "\n".join("    " + line for line in outcome.problem.splitlines())
    return f"{outcome.block}  FAILED\n{problem}"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPOSITORY))
    except ValueError:
        return str(path)
