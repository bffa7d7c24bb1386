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
file, rank 0 the metadata, and the ranks together the manifest (``pipeclock.checkpoints.integrity``),
and once rank 0 has checked, before the rename, that the manifest lists every file ``.metadata`` indexes
and that each is whole: a save is reported only when what export will check is there. A directory with
the suffix is never read, and removed only by a later save of the same step. A run holds its folder for
its whole life (``pipeclock.checkpoints.folder_lock``), so such a ``.partial`` is a dead run's, never one that
another live run is writing; and a run killed mid-save leaves the previous checkpoint the newest one.

A finished checkpoint can still be damaged later (a copy cut short, a full disk, a stray edit): which
checkpoint a path means, checked whole before anything is loaded, and which ones ``--keep-last`` keeps,
is ``pipeclock.checkpoints.choice``.
"""

from __future__ import annotations

import contextlib
import json
import os
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
from pipeclock.checkpoints import choice, integrity, stacked_experts
from pipeclock.checkpoints.choice import CheckpointError
from pipeclock.checkpoints.tied_copies import first_copies_only, restore_second_copies
from pipeclock.engine import faults
from pipeclock.engine.ties import tie_key
from pipeclock.models.registry import full_model

REPLACED = ".replaced"
# One key per parameter for the optimizer too, so each rank saves and loads only its own layers' state.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class Position:
    """Where a saved run stopped: steps done, the last step's loss, and the index of the next batch."""

    step: int
    loss: float
    data_position: int


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
    final = choice.step_dir(root, position.step)
    partial = final.with_name(final.name + choice.PARTIAL)
    if comms.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
        partial.parent.mkdir(parents=True, exist_ok=True)
    comms.barrier(f"preparing {partial}")
    with _explained(f"saving {partial}"), first_copies_only(modules, optimizer):
        state = _full_state(modules, optimizer, position)
        stacked_experts.held_views(modules, state["model"], state["optim"])
        dcp.save(state, checkpoint_id=partial)
    faults.point("save", position.step)
    # DCP's save returns after every rank reported its file written and rank 0 wrote the metadata, so
    # the files are final: the ranks sum them, and the checkpoint is complete when rank 0 renames it.
    files = _manifest(partial)
    problem = None
    if comms.get_rank() == 0:
        description = {"stages": comms.get_world_size(), **run, "step": position.step, "files": files}
        _write_json(partial / choice.RUN_FILE, description)
        problem = _incomplete(partial)
        if problem is None:
            _replace_directory(partial, final)
    problem = comms.all_gather_object(problem, f"checking the save of {partial}")[0]
    if problem:
        raise CheckpointError(f"rank {comms.get_rank()}: saving {partial} failed: {problem}; not renamed")
    return final


def _incomplete(partial: Path) -> str | None:
    """What is missing from a save about to be renamed: the export check (every file in the manifest has
    its size, every item ``.metadata`` indexes lies in a file) and every indexed file in the manifest."""
    try:
        integrity.quick_check(partial, every_file_listed=True)
    except integrity.Damaged as damage:
        return str(damage)
    return None


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
    faults.point("resume", choice.step_of(path))
    with first_copies_only(modules, optimizer) as copies:
        state = _full_state(modules, optimizer, Position(0, 0.0, 0), _rng_source(path))
        with _explained(f"loading {path}"):
            views = stacked_experts.held_views(modules, state["model"], state["optim"], _sizes_at(path))
            dcp.load(state, checkpoint_id=path)
        stacked_experts.restore(views)
        view = GlobalView(modules)
        set_state_dict(
            view,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_OPTIONS,
        )
    restore_second_copies(copies, optimizer)
    _set_rng(state["rng"])
    progress = state["progress"]
    return Position(progress["step"], progress["loss"], progress["data_position"])


def agreed_newest(root: str | os.PathLike) -> Path | None:
    """``newest(root)`` as rank 0 sees it, on every rank: all ranks resume from the same checkpoint."""
    found = choice.newest(root) if comms.get_rank() == 0 else None
    step = -1 if found is None else choice.step_of(found)
    step = torch.tensor(step, dtype=torch.int64, device=comms.device())
    step = int(comms.broadcast(step, 0, "agreeing on the checkpoint to resume from"))
    return None if step < 0 else choice.step_dir(root, step)


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
    problem = choice.damage(Path(path))
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    run = choice.read_run(path)
    model = full_model(run)
    state = {"model": GlobalView([model]).state_dict()}
    stacked_experts.held_views([model], state["model"], saved=_sizes_at(path))
    with warnings.catch_warnings(), _explained(f"loading {path}"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return model, run


def load_weights(path: str | os.PathLike, modules: Sequence[nn.Module]) -> dict:
    """Only ``modules``' weights (one rank's stage) from the checkpoint at ``path``, and its run description.

    No optimizer state and no process group: each rank reads its own keys, whatever the number of stages
    that saved them (generation's way in). Damage is a ``CheckpointError`` naming the file, as for
    ``load_model``.
    """
    problem = choice.damage(Path(path))
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    state = {"model": GlobalView(modules).state_dict()}
    stacked_experts.held_views(modules, state["model"], saved=_sizes_at(path))
    with warnings.catch_warnings(), _explained(f"loading {path}"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return choice.read_run(path)


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


def _sizes_at(path: str | os.PathLike):
    """A function giving each tensor's size as saved at ``path``, by its key within ``model`` or ``optim``."""

    def sizes() -> dict[str, tuple[int, ...]]:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k.split(".", 1)[1]: tuple(v.size) for k, v in metadata.items() if hasattr(v, "size")}

    return sizes


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
    return rank if rank < choice.read_run(path)["stages"] else 0


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
