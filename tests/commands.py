"""Each quoted command runs once per test session, and where it can, without a fresh interpreter.

The course pages quote the labs' commands and the docs test checks every quoted line; the lab tests check
the lessons' properties (ratios, formulas, figures written) in the output of the same runs. Sharing the
runs halves the time the labs take in the suite.

A fresh interpreter costs seconds of imports (torch's, more on a loaded machine), often more than the
command itself. So a ``schedule``, ``plan`` or ``lab N --check FILE`` command runs in this process
(``docs_run.run_here``; a check forks its ranks from it), and
``python -m pipeclock lab N ARGS`` runs the lab's script on ranks forked from the preloaded rank server
(``tests.distributed``), with the environment, arguments and working directory the ``lab`` command gives
it under torchrun, after the line that command prints: it is the lab's work that the pages quote, and the
launch that costs. ``tests/test_docs.py`` runs one of each as typed and checks both against the page.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import runpy
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeclock.cli.arguments import Parser
from tests.distributed import RankOutcome, start_ranks
from tools.docs_run import REPOSITORY, Ran, run_command, run_here, runs_here

LAB = ["python", "-m", "pipeclock", "lab"]


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
    """Run a page's command from the repository root, once per session: in this process where it starts
    no interpreter (``docs_run.runs_here``: schedule, plan, a lab's check), a lab on forked ranks
    (`run_lab_forked`), anything else as typed (``docs_run.run_command``)."""
    started = time.time()
    if runs_here(command):
        return Run(run_here(command), started)
    return Run(run_lab_forked(command) or run_command(command), started)


def run_lab_forked(command: str, deadline: float = 300.0) -> Ran | None:
    """``python -m pipeclock lab N ARGS`` (no ``--check``, no environment words) with the lab's script on
    forked ranks, as many as the command would start; None for any other command."""
    from pipeclock.cli.commands import lab

    words = shlex.split(command)
    if words[: len(LAB)] != LAB or {"--check", "-h", "--help"} & set(words):
        return None
    parser = Parser(prog="pipeclock lab")  # the command's own arguments, read as it reads them
    lab.add_arguments(parser)
    args = parser.parse_args(words[len(LAB) :])
    nproc, lab_args = lab.take_nproc(args.lab_args)
    with contextlib.chdir(REPOSITORY):
        script = lab.find_lab(args.number)
        nproc = nproc or args.nproc or lab.processes(script)
        _, shown = lab.command(script, lab_args, nproc)
    threads = lab.environment(nproc)["OMP_NUM_THREADS"]
    start = time.perf_counter()
    started = start_ranks(run_lab_script, nproc, str(script), lab_args, threads, deadline=deadline)
    outcomes = started.outcomes()
    printed = [o.value if o.ok else None for o in outcomes]
    lines = sorted(line for p in printed if p is not None for line in p.lines)  # by when each was printed
    stdout = f"$ {shown}\n" + "".join(text for _, text in lines)
    stderr = "".join(p.err if p is not None else _failure(o) for p, o in zip(printed, outcomes, strict=True))
    code = max((p.code if p is not None else 1) for p in printed)
    return Ran(code, stdout, stderr, time.perf_counter() - start)


class TimedLines(io.TextIOBase):
    """A rank's standard output as (time, line) pairs: the ranks' lines then merge in the order they
    were printed, as on the terminal (every rank reads the same monotonic clock)."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *done, self._partial = (self._partial + text).split("\n")
        for line in done:
            self._add(line + "\n")
        return len(text)

    def finished(self) -> list[tuple[int, str]]:
        """Every line, the last one as printed even without its newline."""
        if self._partial:
            self._add(self._partial)
            self._partial = ""
        return self.lines

    def _add(self, line: str) -> None:
        """Strictly later than the line before, so that a sort keeps the rank's own order."""
        now = max(time.monotonic_ns(), self.lines[-1][0] + 1 if self.lines else 0)
        self.lines.append((now, line))


@dataclass(frozen=True)
class LabPrinted:
    """What a lab's script said on one rank: its exit code, its standard output's lines with the time
    each was printed, and its standard error."""

    code: int
    lines: list[tuple[int, str]]
    err: str


def run_lab_script(rank: int, world_size: int, script: str, lab_args: list[str], threads: str) -> LabPrinted:
    """On one forked rank: the lab's script as torchrun would run it (``__main__``, its folder first on
    the path, run from the repository root, OpenMP's threads as ``pipeclock lab`` sets them)."""
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.argv = [script, *lab_args]
    sys.path.insert(0, str(Path(script).parent))
    os.chdir(REPOSITORY)
    out, err, code = TimedLines(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return LabPrinted(code, out.finished(), err.getvalue())


def _failure(outcome: RankOutcome) -> str:
    return f"rank {outcome.rank}: {outcome.error_type}: {outcome.error}\n{outcome.value or ''}"
