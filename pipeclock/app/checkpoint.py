"""Checkpoints: save a run, resume it with any number of stages, export it as one plain model.

The format is ``torch.distributed.checkpoint`` (DCP). Every rank writes only what it holds: its layers'
parameters and their Adam state, under the full model's names (``model.layers.7.weight``,
``optim.state.layers.7.weight.exp_avg``), never a stage-local index. DCP's metadata records which file
holds which key, so a checkpoint saved by p stages resumes on p' stages: each rank asks for the keys of
the layers it now holds and DCP reads just those. Besides the model, a checkpoint holds the step, the
last loss, the data position and each rank's RNG state.

On disk, one directory per checkpoint::

    DIR/step_000010/
        .metadata        DCP's index of every key (written by rank 0)
        __0_0.distcp     rank 0's tensors, and the keys every rank shares (step, loss, ...)
        __1_0.distcp     rank 1's tensors
        pipeclock.json   the run's model (kind, size, seed), its stages and training settings, and the
                         manifest: every other file's size and CRC32

A save is atomic: it is written into ``step_000010.partial/`` and renamed once every rank has written its
file, rank 0 the metadata, and the ranks together the manifest (``pipeclock.app.checkpoint_integrity``).
A directory with the suffix is never read, and removed only by a later save of the same step, so a run
killed mid-save leaves the previous checkpoint the newest one.

A finished checkpoint can still be damaged later (a copy cut short, a full disk, a stray edit). Nothing is
loaded before it passes the check: the quick one (``pipeclock.json`` parses, every file has its recorded
size, ``.metadata`` loads and indexes nothing past a file's end: a ``stat`` per file, no tensor read), then
the CRC32s, each rank summing a share of the files. ``choose`` applies it:

- a checkpoint named explicitly (``DIR/step_000010``) is used if it passes, or is one ``CheckpointError``
  naming the file and what is wrong with it;
- a run directory means its newest checkpoint that passes: each newer damaged one is skipped, and said
  so. Every rank takes part in each check and sees the same verdicts, so all resume from the same one.

``prune`` keeps the newest N checkpoints after a save (``--keep-last``): the one just written, and the
newest others that pass the quick check; older step directories go, ``.partial`` ones never.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pipeclock import comms
from pipeclock.app import checkpoint_integrity as integrity
from pipeclock.engine import faults
from pipeclock.engine.ties import tie_key
from pipeclock.models.registry import full_model

PARTIAL = ".partial"
REPLACED = ".replaced"
RUN_FILE = integrity.RUN_FILE
_STEP_DIR = re.compile(r"step_(\d+)")
# One key per parameter for the optimizer too, so each rank saves and loads only its own layers' state.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint could not be found, read or written; the message says which and why."""


@dataclass
class Position:
    """Where a saved run stopped: steps done, the last step's loss, and the index of the next batch."""

    step: int
    loss: float
    data_position: int


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
        path = Path(path)
        why = "it does not exist" if not path.exists() else "no complete step_NNNNNN directory in it"
        raise CheckpointError(f"no checkpoint in {path}: {why}")
    return found


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


# --- saving and loading (every rank calls these together) -------------------------------------------------


def save(
    root: str | os.PathLike,
    position: Position,
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    run: dict,
) -> Path:
    """Save this rank's share of the run after ``position.step`` steps; returns the checkpoint directory.

    ``run`` describes the model (at least ``hidden`` and ``layers``); rank 0 writes it beside DCP's files.
    """
    final = step_dir(root, position.step)
    partial = final.with_name(final.name + PARTIAL)
    if comms.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
        partial.parent.mkdir(parents=True, exist_ok=True)
    comms.barrier(f"preparing {partial}")
    with _explained(f"saving {partial}"):
        dcp.save(_full_state(modules, optimizer, position), checkpoint_id=partial)
    faults.point("save", position.step)
    # DCP's save returns after every rank reported its file written and rank 0 wrote the metadata, so
    # the files are final: the ranks sum them, and the checkpoint is complete when rank 0 renames it.
    files = _manifest(partial)
    if comms.get_rank() == 0:
        description = {"stages": comms.get_world_size(), **run, "step": position.step, "files": files}
        _write_json(partial / RUN_FILE, description)
        _replace_directory(partial, final)
    return final


def _manifest(partial: Path) -> dict[str, dict[str, int]]:
    """Every file's size and CRC32 (on rank 0; None elsewhere), each rank summing its share of the files."""
    rank, world = comms.get_rank(), comms.get_world_size()
    listed = integrity.manifest_files(partial) if rank == 0 else None
    names = comms.all_gather_object(listed, f"listing the files of {partial}")[0]
    mine = integrity.describe_files(partial, integrity.share(names, rank, world))
    shares = comms.gather_object(mine, f"summing the files of {partial}")
    if rank != 0:
        return None
    return dict(sorted((name, entry) for share in shares for name, entry in share.items()))


def _replace_directory(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final``; an older ``final`` (a damaged one, or another timeline's) goes.

    The old one is first renamed aside, so at no moment is a half-deleted directory named like a checkpoint.
    """
    aside = final.with_name(final.name + REPLACED)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(partial, final)
    _sync_directory(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def load(path: str | os.PathLike, modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> Position:
    """Load the checkpoint at ``path`` into this rank's layers and optimizer; returns where it stopped.

    Works whatever the number of stages that saved it: only the keys of this rank's layers are read.
    """
    faults.point("resume", step_of(path))
    state = _full_state(modules, optimizer, Position(0, 0.0, 0), _rng_source(path))
    with _explained(f"loading {path}"):
        dcp.load(state, checkpoint_id=path)
    view = GlobalView(modules)
    set_state_dict(
        view, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS
    )
    _set_rng(state["rng"])
    progress = state["progress"]
    return Position(progress["step"], progress["loss"], progress["data_position"])


def agreed_newest(root: str | os.PathLike) -> Path | None:
    """``newest(root)`` as rank 0 sees it, on every rank: all ranks resume from the same checkpoint."""
    found = newest(root) if comms.get_rank() == 0 else None
    step = torch.tensor(-1 if found is None else step_of(found), dtype=torch.int64, device=comms.device())
    step = int(comms.broadcast(step, 0, "agreeing on the checkpoint to resume from"))
    return None if step < 0 else step_dir(root, step)


# --- the whole model in one process (export) ---------------------------------------------------------------


def load_full_model(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model's ``state_dict`` from the checkpoint at ``path``, and its run description.

    It loads into the model ``models.registry.full_model(run)`` builds (``ShardedMLP(hidden, layers)``,
    or ``gpt_sequential(GPTConfig(**run["gpt"]))``).
    """
    model, run = load_model(path)
    return model.state_dict(), run


def load_model(path: str | os.PathLike) -> tuple[nn.Module, dict]:
    """The whole model, loaded from the checkpoint at ``path``, and its run description.

    Needs no process group: the one process reads every layer's key (a tied weight once). The checkpoint
    is checked whole first (sizes, index, CRC32s), so damage is a ``CheckpointError`` naming the file.
    """
    problem = damage(Path(path))
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    run = read_run(path)
    model = full_model(run)
    state = {"model": GlobalView([model]).state_dict()}
    with warnings.catch_warnings(), _explained(f"loading {path}"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return model, run


# --- what a rank saves ---------------------------------------------------------------------------------


class GlobalView(nn.Module):
    """This rank's chunks as one module whose parameter names are the full model's (``layers.7.weight``).

    DCP's state_dict helpers name the optimizer's state after the parameters of the module they are given;
    seen through this view, layer 7's Adam state is ``state.layers.7.weight.exp_avg`` on whichever rank.
    A tied copy goes by the name of the weight it copies, so the tied weight is stored once (DCP keeps
    one of the identical copies) and loads into every copy.
    """

    def __init__(self, modules: Sequence[nn.Module]):
        super().__init__()
        for module in modules:
            for name, parameter in module.named_parameters():
                _attach(self, tie_key(parameter) or name, parameter)


def _attach(root: nn.Module, name: str, parameter: nn.Parameter) -> None:
    """Register ``parameter`` under the dotted ``name``, creating the plain modules on the way."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if leaf not in module._parameters:
        module.register_parameter(leaf, parameter)


def _full_state(
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    position: Position,
    rng_rank: int | None = None,
) -> dict:
    """The state_dict this rank gives DCP; the same top-level keys on every rank, as DCP requires.

    For a load, the values are placeholders of the right shapes that DCP fills in place; ``rng_rank``
    names the rank whose saved RNG state this rank takes.
    """
    model, optim = get_state_dict(GlobalView(modules), optimizer, options=_OPTIONS)
    rank = comms.get_rank() if rng_rank is None else rng_rank
    return {
        "model": model,
        "optim": optim,
        "progress": {"step": position.step, "loss": position.loss, "data_position": position.data_position},
        "rng": {str(rank): _rng_state()},
    }


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng(saved: dict[str, dict[str, torch.Tensor]]) -> None:
    (state,) = saved.values()
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_source(path: str | os.PathLike) -> int:
    """This rank's own saved RNG state, or rank 0's when the saving run had fewer ranks."""
    rank = comms.get_rank()
    return rank if rank < read_run(path)["stages"] else 0


# --- files and errors ------------------------------------------------------------------------------------


def _write_json(path: Path, content: dict) -> None:
    with open(path, "w") as file:
        json.dump(content, file, indent=2)
        file.flush()
        os.fsync(file.fileno())


def _sync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _explained(what: str) -> Iterator[None]:
    """Turn DCP's failures into pipeclock's: a dead or silent peer is a ``CommError`` naming this rank."""
    try:
        yield
    except dcp.CheckpointException as error:
        raise CheckpointError(f"rank {comms.get_rank()}: {what} failed: {_first_failure(error)}") from None
    except RuntimeError as error:
        raise comms.explain(error, what) from error


def _first_failure(error: dcp.CheckpointException) -> str:
    for rank, (exception, _) in sorted(error.failures.items()):
        return f"on rank {rank}: {type(exception).__name__}: {str(exception).splitlines()[0]}"
    return str(error)
