"""What a learner's loop keeps alive, measured: the micro-batches whose saved tensors still exist.

A forward's graph keeps the tensors its backward will need (autograd's saved tensors) until that
backward frees them, or until nothing refers to the graph any more. A saved-tensor hook sees each one as
it is saved and tags it with the micro-batch (and chunk) whose forward saved it; the tag lives as long
as autograd keeps the tensor. The most tags alive at once is what the loop held, measured rather than
inferred from its order: a loop in the right order that keeps every graph (``retain_graph=True`` and
its outputs kept) holds GPipe's m, where 1F1B holds p − r.

The hook stores the tensor detached: a saved output kept with its ``grad_fn`` would refer to the graph
that refers to it, a cycle that outlives the graph and would count its micro-batch forever.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable

import torch


class Saved:
    """One saved tensor, tagged with the forward that saved it; untagged when autograd lets it go."""

    __slots__ = ("meter", "tag", "tensor")

    def __init__(self, tensor: torch.Tensor, tag: Hashable, meter: HeldMeter) -> None:
        self.tensor, self.tag, self.meter = tensor, tag, meter
        meter.alive[tag] += 1
        meter.peak = max(meter.peak, len(+meter.alive))

    def __del__(self) -> None:
        self.meter.alive[self.tag] -= 1


class HeldMeter:
    """While entered, counts the tensors autograd saves by ``current()``'s tag (None: not counted);
    ``peak`` is the most tags alive at once. One meter a step: a graph of another step is not counted."""

    def __init__(self, current: Callable[[], Hashable | None]) -> None:
        self.current = current
        self.alive: Counter = Counter()
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        tag = self.current()
        return tensor if tag is None else Saved(tensor.detach(), tag, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, Saved) else packed

    def __enter__(self) -> HeldMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
