"""Activation memory, measured: the bytes each micro-batch keeps alive until its backward is done.

During a forward, autograd saves the tensors the backward will need; a saved-tensor hook sees each one.
We add up their sizes (each distinct tensor once, parameters excluded: they are the model, not the
activations) plus what the orchestrator stashes itself (the stage's input and output). A micro-batch's
bytes are held from the end of its ``F`` until the end of its last backward action (``B``, or ``W`` in
split schedules), and the peak of their running sum is the step's activation memory on this rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class ActivationMeter:
    """Measures and tracks the activation bytes of the micro-batches in flight on one rank."""

    def __init__(self, modules: Iterable[nn.Module]):
        self._parameter_storages = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self._bytes: dict[object, int] = {}
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        """Start a new step: nothing held, no peak yet."""
        self._bytes.clear()
        self.live = self.peak = 0

    @contextmanager
    def measuring(self, key: object, stashed: list[torch.Tensor]) -> Iterator[None]:
        """Count what autograd saves inside the block, plus the tensors in ``stashed`` (read at exit)."""
        seen: dict[tuple[int, int], int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self._note(tensor, seen)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        for tensor in stashed:
            self._note(tensor, seen)
        self._bytes[key] = sum(seen.values())

    def _note(self, tensor: torch.Tensor, seen: dict[tuple[int, int], int]) -> None:
        if tensor.untyped_storage().data_ptr() in self._parameter_storages:
            return
        nbytes = tensor.numel() * tensor.element_size()
        seen[(tensor.data_ptr(), nbytes)] = nbytes

    def hold(self, key: object) -> None:
        """The micro-batch ``key`` has finished its forward: its bytes are now held."""
        self.live += self._bytes[key]
        self.peak = max(self.peak, self.live)

    def release(self, key: object) -> None:
        """The micro-batch ``key`` has finished its backward: its bytes are freed."""
        self.live -= self._bytes.pop(key)
