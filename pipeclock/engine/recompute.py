"""Activation recompute: keep a block's input, not its insides, and run the block again in the backward.

Policies (``--recompute``), applied to each chunk of a stage: ``none`` (the default), ``full`` (the
whole chunk one checkpoint: only its inputs kept per micro-batch) and ``every-K`` (every K-th block of the
chunk, the blocks being a ``Sequential``'s children or the chunk's one ``ModuleList``/``ModuleDict``).
Built on ``torch.utils.checkpoint`` (non-reentrant). The math does not change: the rebuilt forward sees
the same inputs, autocast state and dropout keys (each checkpoint re-enters its forward's key). A
checkpointed module keeps its name and parameters, so state dicts, ties and optimizers do not notice.
With a split backward a block is still rebuilt once per micro-batch (``backward.py``). Why, in detail:
docs/engine.md.
"""

from __future__ import annotations

import re
import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import (  # torch 2.13 has no public pytree module; engine/pytree.py says so
    TreeSpec,
    tree_flatten,
    tree_unflatten,
)
from torch.utils.checkpoint import checkpoint

from pipeclock.engine import rng

POLICY_HELP = "none, full, or every-K (K >= 1: checkpoint every K-th block of each chunk)"


@dataclass(frozen=True)
class RecomputePolicy:
    """What to checkpoint in each chunk: nothing, the whole chunk, or every ``every``-th block."""

    name: str = "none"
    every: int | None = None  # None: none or full

    @property
    def enabled(self) -> bool:
        return self.name != "none"


def parse_policy(text: str | RecomputePolicy | None) -> RecomputePolicy:
    """``"none"``, ``"full"`` or ``"every-K"`` as a policy; anything else is a ``ValueError``."""
    if isinstance(text, RecomputePolicy):
        return text
    if text is None or text == "none":
        return RecomputePolicy()
    if text == "full":
        return RecomputePolicy("full")
    match = re.fullmatch(r"every-(\d+)", str(text))
    if match and int(match.group(1)) >= 1:
        return RecomputePolicy(str(text), int(match.group(1)))
    raise ValueError(f"unknown recompute policy {text!r}: use {POLICY_HELP}")


def blocks_of(chunk: nn.Module) -> list[nn.Module]:
    """A chunk's repeated units, in order: what its ``pipeline_blocks()`` names (a Hugging Face stage's
    decoder layers), a ``Sequential``'s children, else its one module list."""
    named = getattr(chunk, "pipeline_blocks", None)
    if callable(named):
        return list(named())
    if isinstance(chunk, nn.Sequential):
        return list(chunk)
    lists = [child for child in chunk.children() if isinstance(child, nn.ModuleList | nn.ModuleDict)]
    if len(lists) == 1:
        return list(lists[0].values()) if isinstance(lists[0], nn.ModuleDict) else list(lists[0])
    return []


def checkpointed_spans(chunk: nn.Module, policy: RecomputePolicy) -> list[nn.Module]:
    """The modules of ``chunk`` whose forward the policy runs under a checkpoint."""
    if isinstance(chunk, DistributedDataParallel):  # a data-parallel replica: its module's blocks
        chunk = chunk.module
    if policy.name == "none":
        return []
    if policy.name == "full":
        return [chunk]
    return [block for index, block in enumerate(blocks_of(chunk)) if (index + 1) % policy.every == 0]


def apply_recompute(chunks: Sequence[nn.Module], policy: str | RecomputePolicy | None) -> set[nn.Module]:
    """Checkpoint the policy's spans in every chunk, in place; every module inside a span, returned.

    Applying it twice is harmless: a span already checkpointed is left as it is.
    """
    policy = parse_policy(policy)
    inside: set[nn.Module] = set()
    for chunk in chunks:
        for span in checkpointed_spans(chunk, policy):
            if not is_checkpointed(span):
                span.forward = types.MethodType(_checkpointed_forward, span)
            inside.update(span.modules())
    return inside


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _checkpointed_forward


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """The module's own forward under a non-reentrant checkpoint (plain when rebuilding, or without grad).

    Early stop is off: the rebuild runs the whole block, so that every module inside it is seen again
    (the split backward collects their inputs then).
    """
    if self in _rebuilding or not torch.is_grad_enabled():  # evaluation: nothing to save or rebuild
        return type(self).forward(self, *args, **kwargs)
    # The checkpoint saves tensor arguments only (anything else it keeps as is, unseen by autograd's
    # saved-tensor hooks and so by the activation meter): hand it the leaves of the arguments.
    leaves, spec = tree_flatten((args, kwargs))
    run = _Run(self, rng.current(), spec)
    return checkpoint(run, *leaves, use_reentrant=False, early_stop=False)


_rebuilding: set[nn.Module] = set()


class _Run:
    """One checkpointed call. The first run is the forward (the module's own hooks fire around it, as for
    any call); the second is the rebuild in the backward, a full call again, so that the module's hooks
    fire then too, under the dropout key the forward saw.
    """

    def __init__(self, module: nn.Module, position: rng.Position, spec: TreeSpec):
        self.module, self.position, self.spec, self.forward_done = module, position, spec, False

    def __call__(self, *leaves):
        args, kwargs = tree_unflatten(list(leaves), self.spec)
        with rng.keyed(self.position.step, self.position.first_sample):
            if not self.forward_done:
                self.forward_done = True
                return type(self.module).forward(self.module, *args, **kwargs)
            _rebuilding.add(self.module)
            try:
                return self.module(*args, **kwargs)
            finally:
                _rebuilding.discard(self.module)
