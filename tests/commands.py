"""Each quoted command runs once per test session.

The course pages quote the labs' commands and the docs test checks every quoted line; the lab tests check
the lessons' properties (ratios, formulas, figures written) in the output of the same runs. Sharing the
runs halves the time the labs take in the suite.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from tools.docs_build import REPOSITORY, Ran, run_command


@dataclass(frozen=True)
class Run:
    ran: Ran
    started: float  # time.time() when the command started: files it wrote are newer

    def output(self) -> str:
        """Its standard output, after asserting that it succeeded."""
        assert self.ran.returncode == 0, self.ran.stdout + self.ran.stderr
        return self.ran.stdout

    def wrote(self, path: str) -> bool:
        """Whether the command wrote ``path`` (relative to the repository root)."""
        written = REPOSITORY / path
        return written.exists() and written.stat().st_mtime >= self.started - 1


@functools.cache
def run_once(command: str) -> Run:
    """Run a page's command from the repository root (``docs_build.run_command``), once per session."""
    started = time.time()
    return Run(run_command(command), started)
