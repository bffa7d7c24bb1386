"""One run per checkpoint folder: of two runs started at once into one folder, exactly one trains.

The lock itself is raced by real processes many times over (cheap: forked processes, no torch work), and
a dead holder is shown to leave the folder free. Then two real ``torchrun`` jobs are started at the same
instant into one folder: one trains and saves checkpoints that pass export's check, the other is refused
in one line naming the folder and the holder, before its first step.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
from pathlib import Path

from pipeclock.checkpoints import folder_lock
from pipeclock.checkpoints.choice import damage
from tests.jobs import Launch

RACES = 20


def _contender(folder: str, start, report, finish) -> None:
    """Lock ``folder`` as soon as every contender is ready; report; hold it until told to finish."""
    start.wait()
    try:
        held = folder_lock.lock(folder)
    except folder_lock.FolderInUseError as error:
        report.put(("refused", os.getpid(), str(error)))
        return
    report.put(("held", os.getpid(), ""))
    finish.wait(30)
    folder_lock.release(held)


def _race(folder: Path, contenders: int = 2) -> list[tuple[str, int, str]]:
    context = mp.get_context("fork")
    start, finish, report = context.Barrier(contenders), context.Event(), context.Queue()
    processes = [
        context.Process(target=_contender, args=(str(folder), start, report, finish))
        for _ in range(contenders)
    ]
    for process in processes:
        process.start()
    outcomes = [report.get(timeout=30) for _ in processes]
    finish.set()
    for process in processes:
        process.join(30)
    return outcomes


def test_of_processes_locking_one_folder_at_the_same_instant_exactly_one_holds_it(tmp_path):
    for race in range(RACES):
        folder = tmp_path / f"race{race}" / "checkpoints"  # not there yet: each contender may create it
        outcomes = _race(folder)
        held = [pid for kind, pid, _ in outcomes if kind == "held"]
        refusals = [message for kind, _, message in outcomes if kind == "refused"]
        assert len(held) == 1 and len(refusals) == 1, outcomes
        assert refusals[0].startswith(
            f"--checkpoint-dir {folder} is in use by another run (pid {held[0]} on host"
        )


def test_a_holder_that_is_killed_leaves_the_folder_free(tmp_path):
    context = mp.get_context("fork")
    start, finish, report = context.Barrier(1), context.Event(), context.Queue()
    holder = context.Process(target=_contender, args=(str(tmp_path), start, report, finish))
    holder.start()
    assert report.get(timeout=30)[0] == "held"
    os.kill(holder.pid, signal.SIGKILL)  # no clean-up of any kind
    holder.join(30)
    folder_lock.release(folder_lock.lock(tmp_path))  # would raise FolderInUseError if still held


# --- two real runs --------------------------------------------------------------------------------------

FLAGS = "--hidden 16 --layers 4 --batch-size 8 --microbatches 2 --steps 2 --checkpoint-every 1 --timeout 30"


def test_two_runs_started_at_once_into_one_folder_one_trains_and_the_other_is_refused_first(tmp_path):
    folder = tmp_path / "checkpoints"
    flags = ["train", *FLAGS.split(), "--checkpoint-dir", str(folder)]
    jobs = [Launch(tmp_path / f"job{n}", 2, flags) for n in range(2)]
    for job in jobs:
        job.proc.wait(timeout=240)
    outs = [job.out.read_text() for job in jobs]
    errs = [job.err.read_text() for job in jobs]
    trained = [n for n, job in enumerate(jobs) if job.proc.returncode == 0]
    assert len(trained) == 1, (outs, errs)
    winner, loser = trained[0], 1 - trained[0]
    assert "final loss" in outs[winner]
    assert "step" not in outs[loser].replace("steps", ""), outs[loser]  # refused before its first step
    refusals = re.findall(r"^pipeclock train: error: (.*)$", errs[loser], re.M)
    assert refusals, errs[loser]
    why = re.compile(
        rf"rank [01]: --checkpoint-dir {folder} is in use by another run \(pid \d+ on host \S+\)|"
        rf"rank [01]: {folder} already holds checkpoints of a run"  # the winner had already finished
    )
    assert all(why.match(line) for line in refusals), refusals
    # What the user sees last: torchrun's own report of the failed ranks, whose exit codes are the
    # ranks' 2, and torchrun's exit code 1 (as docs/guide/errors.md and docs/errors.md say).
    assert jobs[loser].proc.returncode == 1
    last = errs[loser].strip().splitlines()
    assert "exitcode  : 2" in "\n".join(last[-8:]) and set(last[-1]) == {"="}, last[-12:]
    saved = sorted(path for path in folder.iterdir() if path.is_dir())
    assert [path.name for path in saved] == [f"step_{step:06d}" for step in range(1, 3)]
    assert [damage(path) for path in saved] == [None] * 2  # export's whole check, CRC32s included
