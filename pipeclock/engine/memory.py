"""Activation memory, measured: the bytes each micro-batch keeps alive until its backward is done.

During a forward, autograd saves the tensors the backward will need; a saved-tensor hook sees each one.
We add up their sizes (each distinct tensor once, parameters excluded: they are the model, not the
activations) plus what the orchestrator stashes itself (the stage's input and output). A micro-batch's
bytes are held from the end of its ``F`` until the end of its last backward action (``B``, or ``W`` in
split schedules), and the peak of their running sum is the step's activation memory on this rank.

With recompute (``pipeclock.engine.recompute``) a checkpoint saves only its block's inputs, and the hook
sees exactly those: that is what the micro-batch holds until its backward. The block's rebuild inside
the backward is that action's working memory, freed as the backward goes, and is not counted, like the
backward's other temporaries. Between a split backward's I and W, what W needs is counted instead.

A chunk saves the same tensors for every input of the same shapes, so each shape is measured once, on
the first micro-batch that brings it, and its figures are reused after (the caller names the shape:
``measuring(..., shape=)``). The hook costs Python on every saved tensor: at small widths it was a fifth
of an action's engine time. A chunk whose saved tensors depend on its input's values, not only on their
shapes (a mixture of experts routing tokens), is metered by its first micro-batch of each shape.

A tensor split by tensor parallel (a DTensor, saved by a split layer) counts as this rank's part of it,
where it lives: the wrapper has no memory of its own.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ActivationMeter:
    """Measures and tracks the activation bytes of the micro-batches in flight on one rank."""

    def __init__(self, modules: Iterable[nn.Module], w_keeps_graph: bool = False):
        """``w_keeps_graph``: a deferred W goes back through the forward's graph, so B keeps it
        (``update(..., add=True)``); a shape's figures are then complete once its first I is seen."""
        self._modules = list(modules)
        self._w_keeps_graph = w_keeps_graph
        self._known: dict[Hashable, int] = {}  # a shape's forward bytes
        self._known_after_input_grad: dict[Hashable, int] = {}  # and what it holds from I to W
        self._shape_of: dict[object, Hashable] = {}  # each micro-batch's shape
        self._owners: list[nn.Module] | None = None  # the modules holding parameters, found once a step
        self._parameter_pointers: set[int] = set()
        self._bytes: dict[object, int] = {}
        self._forward: dict[object, set[tuple[int, int]]] = {}  # each micro-batch's forward tensors
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        """Start a new step: nothing held, no peak yet."""
        self._bytes.clear()
        self._forward.clear()
        self._shape_of.clear()
        self.live = self.peak = 0
        self._owners = None

    def _parameters(self) -> list[torch.Tensor]:
        """The parameters as the modules hold them now. Walking the module tree costs more than a small
        forward, so the modules that hold parameters are found once a step; the parameters themselves are
        read at every call (a data-parallel wrapper may swap them between forwards)."""
        if self._owners is None:
            self._owners = [m for top in self._modules for m in top.modules() if m._parameters]
        return [p for m in self._owners for p in m._parameters.values() if p is not None]

    def _knows(self, shape: Hashable | None) -> bool:
        if shape is None or shape not in self._known:
            return False
        return not self._w_keeps_graph or shape in self._known_after_input_grad

    @contextmanager
    def measuring(
        self, key: object, stashed: list[torch.Tensor], shape: Hashable | None = None
    ) -> Iterator[None]:
        """Count what autograd saves inside the block, plus the tensors in ``stashed`` (read at exit).

        ``shape``: what the saved bytes depend on (the chunk, its mode, its input's shapes and dtypes);
        a shape already measured is not measured again. None: measure.
        """
        self._shape_of[key] = shape
        if self._knows(shape):
            self._bytes[key] = self._known[shape]
            yield
            return
        saved: list[tuple[int, int]] = []
        # A saved weight is often a view (``weight.t()``) starting where the parameter does. Read now, not
        # once: a data-parallel wrapper (FSDP2) gathers the weights into fresh memory for each forward.
        parameters = self._parameters()
        self._parameter_pointers = {_where(p)[0] for p in parameters}
        parameter_ids = {id(p) for p in parameters}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            # Where and how large, never the tensor, and a detached alias back: a saved *output* kept as
            # itself, or in this closure, would hold its own grad_fn, a cycle through autograd's C++
            # that keeps every step's graph alive (memory grew by a step's activations per step).
            if not is_parameter_cast(tensor, parameter_ids):
                saved.append(_where(tensor))
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        located = _located(stashed)
        self._forward[key] = self._distinct(saved + located)
        self._bytes[key] = sum(nbytes for _, nbytes in self._forward[key])
        if shape is not None:
            self._known[shape] = self._bytes[key]

    def _distinct(self, located: list[tuple[int, int]]) -> set[tuple[int, int]]:
        """The distinct non-parameter tensors among ``located`` (data pointer, bytes) pairs."""
        return {item for item in located if item[0] not in self._parameter_pointers}

    def hold(self, key: object) -> None:
        """The micro-batch ``key`` has finished its forward: its bytes are now held."""
        self.live += self._bytes[key]
        self.peak = max(self.peak, self.live)

    def update(self, key: object, tensors: list[torch.Tensor], add: bool) -> None:
        """The micro-batch ``key`` now holds ``tensors`` instead of (or, with ``add``, besides) its
        forward's tensors: a split backward's B frees the graph but keeps what W needs. Besides: a tensor
        both saved by the forward and kept for W (a Linear's input) is counted once."""
        shape = self._shape_of.get(key)
        if add and key not in self._forward:  # a shape measured before: its figure is known
            held = self._known_after_input_grad[shape]
        else:
            kept = self._distinct(_located(tensors))
            if add:
                kept |= self._forward[key]
                if shape is not None:
                    self._known_after_input_grad[shape] = sum(nbytes for _, nbytes in kept)
            held = sum(nbytes for _, nbytes in kept)
        self.live += held - self._bytes[key]
        self._bytes[key] = held
        self.peak = max(self.peak, self.live)

    def release(self, key: object) -> None:
        """The micro-batch ``key`` has finished its backward: its bytes are freed."""
        self.live -= self._bytes.pop(key)
        self._forward.pop(key, None)
        self._shape_of.pop(key, None)


def _located(tensors: list) -> list[tuple[int, int]]:
    """(data pointer, bytes) of each tensor. Anything else a stage returned (a number, None, a cache
    object) holds no activation memory here, and is the engine's to refuse with its own message (what a
    stage may send), not the meter's to trip over."""
    return [_where(t) for t in tensors if isinstance(t, torch.Tensor)]


def _where(tensor: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the memory ``tensor`` occupies on this rank: a DTensor's local part."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            tensor = tensor.to_local()
    return tensor.data_ptr(), tensor.nbytes


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def is_parameter_cast(tensor: torch.Tensor, parameter_ids: set[int]) -> bool:
    """A parameter in autocast's compute dtype (or a view of one): the model, not an activation.

    ``parameter_ids`` are the ``id`` of the float32 parameters the cast may come from.
    """
    base = tensor._base
    node = (tensor if base is None else base).grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0":  # the type's name: no call into C++
        return False
    source = node.next_functions[0][0]
    return id(getattr(source, "variable", None)) in parameter_ids
