"""A long search's progress on stderr: nothing for the first second, then a line the terminal rewrites
in place, or, when stderr is not a terminal (a log, a pipe), that line once and no more.

Stdout stays the plan's alone (``--json`` is read by programs); a search that answers within a second
prints nothing here.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

QUIET_SECONDS = 1.0  # a search shorter than this shows no progress
REFRESH_SECONDS = 0.25  # the terminal's line is rewritten at most this often


class SearchProgress:
    """Called by `pipeclock.plan.search.search` with what it is doing; `close` clears the line."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self.shown = 0.0
        self.terminal = self.stream.isatty()
        self.width = 0
        self.printed_once = False

    def __call__(self, considered: int, judged: int, best: float | None) -> None:
        now = time.perf_counter()
        if now - self.started < QUIET_SECONDS or now - self.shown < REFRESH_SECONDS or self.printed_once:
            return
        self.shown = now
        line = f"pipeclock plan: searching: {considered:,} configurations considered, {judged:,} judged"
        if best is not None:
            line += f", best step so far {best:.3g} s"
        if self.terminal:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + " ...\n")
            self.printed_once = True
        self.stream.flush()

    def close(self) -> None:
        if self.terminal and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
