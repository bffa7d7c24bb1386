"""Running a course page's command: as typed, in a process group of its own with a timeout; or, where a
fresh interpreter would cost more than the command, in the caller's own process (``tools.docs_build``
and the tests use both).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
SIMULATOR = "python -m pipeclock schedule"  # the simulator's commands: the --quick build
# Commands that start no interpreter and leave no state behind: run in the builder's own process. The
# loop labs' check (4 to 7) forks its ranks from the process it runs in, imports the learner's file only in
# them, and waits for them all before it answers; lab 12's check imports the file in its caller, so not it.
IN_PROCESS = (SIMULATOR + " ", "python -m pipeclock plan ")
LAB_CHECK = re.compile(r"python -m pipeclock lab [4-7] --check \S+")
COMMAND_TIMEOUT = 300.0  # seconds; a command still running then is killed with its process group


def runs_here(command: str) -> bool:
    """A ``schedule``, ``plan`` or ``lab N --check FILE`` command, as typed (no environment words): it
    starts no interpreter."""
    return command.startswith(IN_PROCESS) or LAB_CHECK.fullmatch(command) is not None


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.stdout.rstrip("\n").splitlines()] if self.stdout else []


def run_command(command: str, timeout: float = COMMAND_TIMEOUT) -> Ran:
    """Run a page's command from the repository root, as a learner in the virtual environment would.

    It runs in its own process group, so a command still running after ``timeout`` seconds is killed
    together with everything it started (torchrun and its workers).
    """
    words = shlex.split(command)
    env = dict(os.environ)
    # Unbuffered, Python writes a line and its newline separately, and two ranks' lines can interleave.
    env.pop("PYTHONUNBUFFERED", None)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    start = time.perf_counter()
    process = subprocess.Popen(
        words, cwd=REPOSITORY, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(process.pid)
        stdout, stderr = process.communicate()
        stderr += f"\n(killed after {timeout:g} s)"
    _end_group(process.pid)  # whatever the command left behind
    return Ran(process.returncode, stdout, stderr, time.perf_counter() - start)


def run_here(command: str) -> Ran:
    """A command that `runs_here` run in this process, from the repository root: it starts no
    interpreter, and a fresh one would cost more than the command (torch's import, every time). What it
    prints goes to line-buffered files that the processes a check forks inherit, so their lines (a
    learner's print) are caught too, in the order written. No timeout of its own: a check's ranks have
    the checker's. ``tests/test_docs.py`` checks that a typed run prints the same."""
    from pipeclock.cli.dispatch import main

    words = shlex.split(command)[3:]  # after "python -m pipeclock"
    argv, cwd = sys.argv, Path.cwd()
    torch = sys.modules.get("torch")  # a simulator command imports none
    threads = torch.get_num_threads() if torch else None
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+", buffering=1) as out, tempfile.TemporaryFile("w+", buffering=1) as err:
        try:
            os.chdir(REPOSITORY)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(words)
        finally:
            os.chdir(cwd)
            sys.argv = argv
            if threads is not None:  # a plan that measures sets them: the builder's stay as they were
                torch.set_num_threads(threads)
        return Ran(code, _read(out), _read(err), time.perf_counter() - start)


def _read(printed: io.TextIOBase) -> str:
    printed.seek(0)
    return printed.read()


def _end_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
