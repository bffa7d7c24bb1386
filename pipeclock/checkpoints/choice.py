"""Which checkpoint: where checkpoints live, which one a path means, and which to keep.

A run's checkpoints are ``DIR/step_NNNNNN`` directories (``pipeclock.checkpoints.save_load`` writes them; a
``.partial`` one is a save not finished). Nothing is loaded before it passes the check
(``pipeclock.checkpoints.integrity``): the quick one (``pipeclock.json`` parses, every file has its
recorded size, ``.metadata`` indexes nothing past a file's end), then the CRC32s, each rank summing a
share of the files. ``choose`` applies it:

- a checkpoint named explicitly (``DIR/step_000010``) is used if it passes, or is one ``CheckpointError``
  naming the file and what is wrong with it;
- a run directory means its newest checkpoint that passes: each newer damaged one is skipped, and said
  so. Every rank takes part in each check and sees the same verdicts, so all resume from the same one.

``prune`` keeps the newest N checkpoints after a save (``--keep-last``): the one just written, and the
newest others that pass the quick check; older step directories go, ``.partial`` ones never.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeclock import comms
from pipeclock.checkpoints import integrity

PARTIAL = ".partial"
RUN_FILE = integrity.RUN_FILE
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint could not be found, read or written; the message says which and why."""


# --- where checkpoints live ------------------------------------------------------------------------------


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint taken after ``step`` steps."""
    return Path(root) / f"step_{step:06d}"


def step_of(path: str | os.PathLike) -> int:
    """The step a checkpoint directory was taken at (``step_000010`` -> 10)."""
    return int(_STEP_DIR.fullmatch(Path(path).name).group(1))


def newest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None; ``.partial`` directories never count."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = [path for path in root.iterdir() if _STEP_DIR.fullmatch(path.name) and _is_complete(path)]
    return max(complete, key=step_of, default=None)


def resolve(path: str | os.PathLike) -> Path:
    """``choose(path)`` for one process: the checkpoint ``path`` names, or its run's newest sound one."""
    found = choose(path, together=False).path
    if found is None:
        raise none_in(Path(path))
    return found


def none_in(path: Path) -> CheckpointError:
    """The error for a path that holds no checkpoint, saying why."""
    why = "it does not exist" if not path.exists() else "no complete step_NNNNNN directory in it"
    return CheckpointError(f"no checkpoint in {path}: {why}")


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / RUN_FILE).is_file()


def read_run(path: str | os.PathLike) -> dict:
    """The run description saved with a checkpoint (hidden, layers, seed, stages, chunks, schedule, step).

    A missing or garbled ``pipeclock.json`` is a ``CheckpointError`` naming it.
    """
    try:
        return integrity.read_run(Path(path))
    except integrity.Damaged as damage:
        raise _damaged(Path(path), damage) from None


# --- which checkpoint to use, and which to keep -------------------------------------------------------------


@dataclass
class Choice:
    """The checkpoint to load (None: there is none yet) and the newer ones skipped as damaged, with why."""

    path: Path | None
    skipped: list[tuple[Path, str]]

    def skipped_lines(self, doing: str = "resuming from") -> list[str]:
        """One line per damaged checkpoint passed over: ``checkpoint X is damaged (why); resuming from Y``."""
        name = self.path.name
        return [f"checkpoint {path} is damaged ({why}); {doing} {name}" for path, why in self.skipped]


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` names one checkpoint (``step_NNNNNN``, or a directory holding DCP's index or ours)."""
    path = Path(path)
    return bool(_STEP_DIR.fullmatch(path.name)) or (path / ".metadata").exists() or (path / RUN_FILE).exists()


def choose(target: str | os.PathLike, *, together: bool = True) -> Choice:
    """The checkpoint ``target`` means, checked whole.

    ``target`` is one checkpoint (used if sound, else ``CheckpointError``) or a run directory (its newest
    sound checkpoint; the damaged newer ones are listed in ``skipped``). A run directory with no
    checkpoint yet gives ``Choice(None, [])``; one whose every checkpoint is damaged is an error.
    ``together``: every rank calls it, shares the checking, and gets the same answer; else this process
    alone checks (export, generate).
    """
    target = Path(target)
    check = agreed_damage if together else damage
    if target.name.endswith(PARTIAL):
        raise CheckpointError(f"{target} is an unfinished save ({PARTIAL}): name a complete checkpoint")
    if is_checkpoint(target):
        if not target.is_dir():
            raise CheckpointError(f"no checkpoint at {target}: it does not exist")
        problem = check(target)
        if problem:
            raise CheckpointError(f"checkpoint {target} is damaged: {problem}")
        return Choice(target, [])
    skipped = []
    for candidate in _agreed_candidates(target) if together else _step_dirs(target):
        problem = check(candidate)
        if problem is None:
            return Choice(candidate, skipped)
        skipped.append((candidate, problem))
    if skipped:
        listed = ", ".join(f"{path.name} ({why})" for path, why in skipped)
        raise CheckpointError(f"every checkpoint in {target} is damaged: {listed}")
    return Choice(None, [])


def damage(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with the checkpoint at ``path`` (``"__1_0.distcp: truncated to 812 of 4096 bytes"``).

    None if nothing is. The quick check, then the CRC32s of rank ``rank``'s share of the files (all of
    them by default).
    """
    try:
        run = integrity.quick_check(path)
        integrity.check_sums(path, run, integrity.share(integrity.summed_files(run), rank, world))
    except integrity.Damaged as found:
        return str(found)
    return None


def agreed_damage(path: Path) -> str | None:
    """``damage(path)`` with the sums shared out: every rank sees every verdict and reports the first."""
    mine = damage(path, comms.get_rank(), comms.get_world_size())
    verdicts = comms.all_gather_object(mine, f"checking {path}")
    return next((verdict for verdict in verdicts if verdict), None)


def sound_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The checkpoints under ``root`` that pass the quick check, newest first (rank 0's view, no sums)."""
    return [path for path in _step_dirs(root) if _passes_quick_check(path)]


def prune(root: str | os.PathLike, keep: int, just_written: Path) -> list[Path]:
    """Delete every checkpoint under ``root`` older than the newest ``keep`` ones; returns the deleted.

    The ones kept are ``just_written`` and the newest others that pass the quick check (a damaged one
    does not take a place). Only complete ``step_NNNNNN`` directories are considered: a ``.partial`` one
    (perhaps another run's save in progress) is never touched. Rank 0 alone calls it.
    """
    others = [path for path in sound_checkpoints(root) if path != just_written]
    kept = [just_written, *others[: keep - 1]]
    oldest_kept = min(step_of(path) for path in kept)
    doomed = [path for path in _step_dirs(root) if step_of(path) < oldest_kept and path not in kept]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _agreed_candidates(root: Path) -> list[Path]:
    """Rank 0's list of the checkpoint directories under ``root``, newest first, on every rank."""
    mine = _step_dirs(root) if comms.get_rank() == 0 else None
    return comms.all_gather_object(mine, f"listing the checkpoints in {root}")[0]


def _step_dirs(root: str | os.PathLike) -> list[Path]:
    """Every ``step_NNNNNN`` directory under ``root`` (finished saves, sound or not), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if _STEP_DIR.fullmatch(path.name) and path.is_dir()]
    return sorted(found, key=step_of, reverse=True)


def _passes_quick_check(path: Path) -> bool:
    try:
        integrity.quick_check(path)
    except integrity.Damaged:
        return False
    return True


def _damaged(path: Path, damage: integrity.Damaged) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is damaged: {damage}")
