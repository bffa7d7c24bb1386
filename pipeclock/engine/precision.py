"""Mixed precision: bf16 compute and bf16 messages, float32 everything that accumulates.

``--dtype bf16`` runs each chunk's forward under ``torch.autocast``; parameters, their gradients and the
optimizer's state stay float32 (no loss scaling: bf16 has float32's exponent range). ``step_region`` holds
one autocast region open around the whole step, so a weight is cast once per step and the micro-batches
in flight share one bf16 copy. The loss is computed in float32. Messages between stages travel in bf16
and are widened on arrival to the dtype they were sent from, so a float32 residual stream is rounded
once at the cut, as on one process. Why, when it is faster, and what it costs in accuracy:
docs/engine.md and docs/benchmarks.md.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from pipeclock.engine import pytree

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """The compute dtype of a run: ``fp32`` (plain) or ``bf16`` (autocast, bf16 messages)."""

    name: str = "fp32"

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None for plain float32."""
        return DTYPES[self.name]

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype floating-point messages travel in, or None to send them as they are."""
        return DTYPES[self.name]

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Around a chunk's forward."""
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def step_region(self, device: torch.device) -> AbstractContextManager:
        """Around a whole step: autocast off (backwards run outside autocast), its weight cache kept."""
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype, enabled=False)

    def for_loss(self, tree: pytree.Tree) -> pytree.Tree:
        """The last chunk's output with its low-precision floating leaves widened to float32."""
        if self.compute_dtype is None:
            return tree
        return pytree.tree_map(_widen, tree)


def _widen(leaf: torch.Tensor) -> torch.Tensor:
    if leaf.is_floating_point() and leaf.element_size() < 4:
        return leaf.float()
    return leaf


def parse_precision(value: str | Precision | None) -> Precision:
    """``"fp32"`` or ``"bf16"`` (or None: fp32) as a ``Precision``; anything else is a ``ValueError``."""
    if isinstance(value, Precision):
        return value
    name = "fp32" if value is None else value
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {value!r}: use {' or '.join(DTYPES)}")
    return Precision(name)
