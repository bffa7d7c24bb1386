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
        # A saved weight is often a view (``weight.t()``) starting where the parameter does.
        self._parameter_pointers = {p.data_ptr() for m in modules for p in m.parameters()}
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
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)  # the hook runs per saved tensor: keep it to an append
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self._bytes[key] = self._distinct_bytes(saved + stashed)

    def _distinct_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of the distinct non-parameter tensors among ``tensors``."""
        seen: dict[tuple[int, int], int] = {}
        for tensor in tensors:
            pointer = tensor.data_ptr()
            if pointer not in self._parameter_pointers:
                nbytes = tensor.numel() * tensor.element_size()
                seen[(pointer, nbytes)] = nbytes
        return sum(seen.values())

    def hold(self, key: object) -> None:
        """The micro-batch ``key`` has finished its forward: its bytes are now held."""
        self.live += self._bytes[key]
        self.peak = max(self.peak, self.live)

    def update(self, key: object, tensors: list[torch.Tensor], add: bool) -> None:
        """The micro-batch ``key`` now holds ``tensors`` instead of (or, with ``add``, besides) its
        forward's tensors: a split backward's B frees the graph but keeps what W needs."""
        held = self._distinct_bytes(tensors) + (self._bytes[key] if add else 0)
        self.live += held - self._bytes[key]
        self._bytes[key] = held
        self.peak = max(self.peak, self.live)

    def release(self, key: object) -> None:
        """The micro-batch ``key`` has finished its backward: its bytes are freed."""
        self.live -= self._bytes.pop(key)
