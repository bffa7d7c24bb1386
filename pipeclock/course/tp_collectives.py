"""The learner's all-reduces in ``lab 12 --check``, watched: right numbers can still be wrong code.

``dist.all_reduce`` sums in place and autograd does not know it. Three uses give the right numbers on the
checker's small MLP and are wrong all the same, as the lab's page says:

- in an autograd Function's forward, on the Function's own input (no copy): the input is a tensor autograd
  may still need, and a Function that changes its input in place must say so (``ctx.mark_dirty``);
- in a Function's backward, on the gradient it was handed (no copy): that gradient may be used elsewhere
  in the graph;
- bare, in a module's forward, on a tensor that carries a gradient: autograd passes the gradient through
  an operation it does not know; torch warns that this "may lead to silently incorrect behavior".

And a column split's forward needs no sum at all. `Collectives` wraps ``dist.all_reduce`` and the
forward and backward of the Functions the learner's file defines, and raises `Misused` with the line of
the learner's file that made the call.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

COPY = "the sum works in place: all-reduce a copy"


class Misused(Exception):
    """An all-reduce the page calls wrong: ``str`` is the line that says why (without the rank)."""


@dataclass
class Inside:
    """A learner's Function running its ``kind`` ("forward" or "backward"), and the storages of the
    tensors it was handed."""

    name: str
    kind: str
    storages: set[int]
    changed: int | None = None  # the storage of an input it all-reduced in place


@dataclass
class Collectives:
    """Installs the watch on ``module`` (the learner's file, loaded) and ``dist.all_reduce``;
    ``phase()`` names the check's phase (the column forward allows no sum)."""

    learner: Path
    phase: Callable[[], str]
    inside: list[Inside] = field(default_factory=list)
    where: str = ""  # the line of the last in-place sum of a Function's input

    def install(self, module: ModuleType) -> None:
        for value in vars(module).values():
            mine = isinstance(value, type) and value.__module__ == module.__name__
            if mine and issubclass(value, torch.autograd.Function):
                self._wrap(value, "forward")
                self._wrap(value, "backward")
        original = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            self.judge(tensor)
            return original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce

    def _wrap(self, function: type, kind: str) -> None:
        original = getattr(function, kind)

        def wrapped(*args):
            handed = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
            inside = Inside(function.__name__, kind, handed)
            self.inside.append(inside)
            try:
                result = original(*args)
            finally:
                self.inside.pop()
            if inside.changed is not None and not _marked_dirty(args[0], inside.changed):
                raise Misused(
                    f"{inside.name}'s forward all-reduces its own input in place{self.where}: {COPY} "
                    "(x.clone()); a Function that changes its input in place must tell autograd so "
                    "(ctx.mark_dirty)"
                )
            return result

        setattr(function, kind, staticmethod(wrapped))

    def judge(self, tensor: torch.Tensor) -> None:
        """Raise `Misused` when this all-reduce of ``tensor`` is one the page calls wrong."""
        where = self.line()
        if self.phase() == "ColumnParallelLinear's forward":
            raise Misused(
                f"ColumnParallelLinear's forward calls all_reduce{where}: a column split's forward needs no "
                "sum (each rank's output features are whole); its one all-reduce is in the backward "
                "(SumGradientsOverRanks's backward)"
            )
        inside = self.inside[-1] if self.inside else None
        if inside is not None and _storage(tensor) in inside.storages:
            if inside.kind == "forward":  # allowed when the Function says so: seen once it returns
                inside.changed, self.where = _storage(tensor), where
                return
            raise Misused(
                f"{inside.name}'s backward all-reduces the gradient it was handed in place{where}: {COPY} "
                "(grad.clone()); the gradient handed to a backward may be used elsewhere in the graph"
            )
        if inside is None and torch.is_grad_enabled() and tensor.requires_grad:
            raise Misused(
                f"a bare dist.all_reduce in a forward{where}: autograd passes the gradient through an "
                'operation it does not know; torch warns that this "may lead to silently incorrect '
                'behavior" and will stop working: sum in an autograd Function (SumOverRanks)'
            )

    def line(self) -> str:
        """`` (line 12 of FILE: `code`)``: the learner's line that called the all-reduce."""
        mine = [f for f in traceback.extract_stack() if Path(f.filename).resolve() == self.learner]
        if not mine:
            return ""
        frame = mine[-1]
        return f" (line {frame.lineno} of {os.path.relpath(self.learner)}: `{(frame.line or '').strip()}`)"


def _marked_dirty(ctx, storage: int) -> bool:
    """Whether the Function's forward told autograd (``ctx.mark_dirty``) that it changed ``storage``."""
    dirty = getattr(ctx, "dirty_tensors", None) or ()
    return any(isinstance(t, torch.Tensor) and _storage(t) == storage for t in dirty)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
