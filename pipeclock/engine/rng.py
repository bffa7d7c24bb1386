"""Random numbers that do not depend on how the model is cut: dropout keyed by (seed, step, sample, layer).

A dropout mask drawn from the global generator depends on everything drawn before it: on one process the
layers run in one order over the whole batch, on p stages each rank draws for its own layers and its own
micro-batches, so the same seed gives other masks, other losses and other gradients. pipeclock draws no
state at all: each mask element is a hash of (seed, step, layer, the sample's index in the batch, the
element's index in the sample). The same sample in the same step meets the same mask at the same layer,
whatever the number of stages, the schedule, the placement or the number of micro-batches, so pipelined
dropout equals one-device dropout exactly.

The orchestrator says which step and which samples a forward sees (``keyed``); outside any ``keyed``
block the step is 0 and the batch starts at sample 0, so a plain one-process call is reproducible too.
The hash is a few integer operations on the tensor's device: no generator, no state to save or restore.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows.
_MULTIPLIERS = (0x5BD1E995, 0x27D4EB2F)


@dataclass(frozen=True)
class Position:
    """Where the samples of the forward being run sit: the training step and the first sample's index."""

    step: int = 0
    first_sample: int = 0


_current = Position()


@contextmanager
def keyed(step: int, first_sample: int) -> Iterator[None]:
    """Forwards inside the block see samples ``first_sample, first_sample + 1, ...`` of step ``step``."""
    global _current
    saved, _current = _current, Position(step, first_sample)
    try:
        yield
    finally:
        _current = saved


def current() -> Position:
    return _current


def _mix(values: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 ``values`` in [0, 2**32)."""
    values = ((values ^ (values >> 16)) * _MULTIPLIERS[0]) & _MASK32
    values = ((values ^ (values >> 13)) * _MULTIPLIERS[1]) & _MASK32
    return values ^ (values >> 16)


def _mix_int(*parts: int) -> int:
    """``_mix`` on plain Python integers, folded one after the other (no tensor on the hot path)."""
    value = 0
    for part in parts:
        value = (value ^ part) & _MASK32
        value = ((value ^ (value >> 16)) * _MULTIPLIERS[0]) & _MASK32
        value = ((value ^ (value >> 13)) * _MULTIPLIERS[1]) & _MASK32
        value ^= value >> 16
    return value


def key(*parts: int) -> int:
    """One 32-bit key from integers (a seed, a step, a sample, a layer ...): a hash, distinct for distinct
    tuples in practice, and the same on every rank."""
    return _mix_int(*(part & _MASK32 for part in parts))


def uniform(shape: torch.Size, key: int, device: torch.device) -> torch.Tensor:
    """Uniform numbers in [0, 1) for a batch of ``shape``, keyed by (``key``, step, sample, element).

    Dimension 0 is the batch: row i belongs to sample ``current().first_sample + i``.
    """
    position = current()
    base = _mix_int(key, position.step)
    samples = torch.arange(shape[0], dtype=torch.int64, device=device) + position.first_sample
    per_sample = _mix((samples + base) & _MASK32)
    elements = torch.arange(shape[1:].numel(), dtype=torch.int64, device=device)
    bits = _mix(per_sample[:, None] ^ elements[None, :])
    return ((bits >> 8).to(torch.float32) * 2.0**-24).reshape(shape)


class KeyedDropout(nn.Module):
    """Dropout whose mask is keyed by (seed, ``layer``, step, sample, element) instead of drawn.

    ``layer`` must be unique among the model's dropouts (e.g. 2 * block + 1 and 2 * block + 2). In
    ``eval()`` mode, or with ``p == 0``, it is the identity, like ``nn.Dropout``.
    """

    def __init__(self, p: float, layer: int, seed: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.layer, self.seed = p, layer, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return self._dropped(x)

    @torch.compiler.disable
    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Eager even inside a compiled block: the mask reads the step and sample from Python state, which
        a compiled graph would take as constants (and recompile for at every micro-batch)."""
        keep = uniform(x.shape, _mix_int(self.seed, self.layer), x.device) >= self.p
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"
