"""``pipeclock lab N [args]``: run lab N from ``labs/``, under torchrun when it needs processes.

A lab that needs processes says how many with a ``PROCESSES = n`` line; this command prints the
torchrun command a learner would type, then runs it. ``--nproc N`` (before or after the lab's number)
asks for another number of processes, e.g. to see a four-stage pipeline. ``--check FILE`` runs the
learner's loop in FILE (from ``labs/exercises/``) on real processes instead, and says whether it is
right (`pipeclock.course.check`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from pipeclock.cli.arguments import Parser, positive_int
from pipeclock.cli.checkout import checkout_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("number", type=positive_int, help="which lab (1, 2, ...)")
    parser.add_argument(
        "--nproc",
        type=positive_int,
        metavar="N",
        help="processes for torchrun (default: the lab's PROCESSES)",
    )
    parser.add_argument(
        "--check", type=Path, metavar="FILE", help="check your loop for this lab's schedule, written in FILE"
    )
    parser.add_argument("lab_args", nargs=argparse.REMAINDER, help="arguments passed on to the lab")


def find_lab(number: int) -> Path:
    """The script of lab ``number`` in the checkout's ``labs/``; a one-line exit if there is none."""
    labs = checkout_folder("labs", "lab")
    found = sorted(labs.glob(f"{number:02d}_*.py"))
    if not found:
        known = ", ".join(p.stem for p in sorted(labs.glob("[0-9][0-9]_*.py"))) or "none"
        raise SystemExit(f"pipeclock lab: error: no lab {number} in {labs} (labs: {known})")
    return found[0]


def processes(lab: Path) -> int:
    match = re.search(r"^PROCESSES = (\d+)", lab.read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 1


def take_nproc(lab_args: list[str]) -> tuple[int | None, list[str]]:
    """``--nproc N`` written after the lab's number belongs to the launcher, not to the lab."""
    known, rest = _launcher_options(lab_args)
    return known.nproc, rest


def _launcher_options(lab_args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    launcher = Parser(prog="pipeclock lab", add_help=False, allow_abbrev=False)
    launcher.add_argument("--nproc", type=positive_int)
    launcher.add_argument("--check", type=Path)
    return launcher.parse_known_args(lab_args)


def check(number: int, learner: Path) -> int:
    """``lab N --check FILE``: the checker's answer, printed; 0 when the loop is right."""
    from pipeclock.course import tp_check
    from pipeclock.course.check import EXERCISES, Verdict
    from pipeclock.course.check import check as check_loop

    if number == tp_check.LAB:
        return tp_check.answer(learner)
    if number not in EXERCISES:
        labs = ", ".join(map(str, [*EXERCISES, tp_check.LAB]))
        print(f"pipeclock lab: error: lab {number} has no loop to check; the labs that do: {labs}",
              file=sys.stderr)  # fmt: skip
        return 2
    if not learner.is_file():
        print(f"pipeclock lab: error: --check {learner}: no such file", file=sys.stderr)
        return 2
    print(f"checking {learner} for lab {number}, on 2 and 4 processes...", flush=True)
    try:
        print(check_loop(number, learner))
        return 0
    except Verdict as verdict:
        print(verdict)
        return 1


def command(lab: Path, lab_args: list[str], nproc: int | None = None) -> tuple[list[str], str]:
    """The command to run, and how a learner would type it."""
    shown = os.path.relpath(lab)
    nproc = processes(lab) if nproc is None else nproc
    if nproc < 1:
        raise SystemExit(f"pipeclock lab: --nproc must be at least 1, got {nproc}")
    if nproc == 1:
        return [sys.executable, str(lab), *lab_args], shlex.join(["python", shown, *lab_args])
    launcher = ["--standalone", "--nproc-per-node", str(nproc)]
    run = [sys.executable, "-m", "torch.distributed.run", *launcher, str(lab), *lab_args]
    return run, shlex.join(["torchrun", "--nproc-per-node", str(nproc), shown, *lab_args])


def check_lab_arguments(lab: Path, lab_args: list[str]) -> None:
    """The lab's own parser reads ``lab_args`` here, once, before torchrun starts any process: a wrong
    argument is then the lab's one error line (exit code 2), not that line from every rank followed by
    torchrun's report and traceback. Costs the lab's imports, so only when it is given arguments."""
    spec = importlib.util.spec_from_file_location(f"pipeclock_lab_{lab.stem}", lab)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(lab.parent))  # as when the script runs: its folder first (labs/solutions)
    try:
        spec.loader.exec_module(module)  # a lab's work runs under ``if __name__ == "__main__"`` only
    finally:
        sys.path.remove(str(lab.parent))
    parse = getattr(module, "parse_args", None)
    if parse is None:
        return
    program, sys.argv[0] = sys.argv[0], str(lab)  # argparse names the program after sys.argv[0]
    try:
        parse(lab_args)  # argparse's SystemExit(2), its message printed, for cli.main to return
    finally:
        sys.argv[0] = program


def run(args: argparse.Namespace) -> int:
    after, lab_args = _launcher_options(args.lab_args)
    if (after.check or args.check) is not None:
        return check(args.number, after.check or args.check)
    lab = find_lab(args.number)
    nproc_after = after.nproc
    nproc = next((n for n in (nproc_after, args.nproc) if n is not None), processes(lab))
    if {"-h", "--help"} & set(lab_args):
        nproc = 1  # the lab's help needs no process group, and would be printed once per process
    if lab_args and nproc > 1:
        check_lab_arguments(lab, lab_args)
    cmd, shown = command(lab, lab_args, nproc)
    print(f"$ {shown}", flush=True)
    return _wait(subprocess.Popen(cmd, env=environment(nproc)))


def environment(nproc: int) -> dict[str, str]:
    """The lab's environment: the cores shared among its processes, and threads that sleep while they
    wait for each other. OpenMP's threads otherwise spin: on a machine busy with other work, two threads
    of one process then burn the core the other one needs, and a one-process lab's step was measured 17
    times slower (docs/benchmarks.md). The user's own settings win."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _wait(lab: subprocess.Popen) -> int:
    """The lab's exit code. Ctrl-C reaches the lab (and its torchrun) too: let it end in its own way
    rather than killing it halfway, which would leave torchrun's ranks behind."""
    try:
        return lab.wait()
    except KeyboardInterrupt:
        try:
            lab.wait(timeout=60)
        except subprocess.TimeoutExpired:
            lab.kill()
        raise
