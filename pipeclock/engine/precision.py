"""Mixed precision: bf16 compute and bf16 messages, float32 everything that accumulates.

``--dtype bf16`` runs each chunk's forward under ``torch.autocast``: matrix products take bf16 inputs
(and so does their backward), while the parameters stay float32, as do their gradients (autograd casts
each weight's bf16 gradient back before adding it to ``.grad``) and the optimizer's state. So the small
updates that training adds step after step are not rounded away, which is what float32 master weights are
for. bf16 keeps float32's exponent range, so no loss scaling is needed (float16 would need it).

Autocast casts each weight to bf16 when a forward first uses it and caches the copy until the outermost
autocast region closes. Each forward is its own region, so ``step_region`` holds one (disabled) region
open around the whole step: a weight is cast once per step, not once per micro-batch, and all the
micro-batches in flight share one bf16 copy (half the float32 parameters' bytes) instead of each keeping
its own for its backward. That copy is the model in the compute dtype: the activation meter counts it
with the parameters, not with the activations.

The loss is computed in float32 from the last chunk's output. What travels between stages, activations
forward and gradients back, travels in bf16: half the bytes of float32, and is widened on arrival to
the dtype it was sent from. So a transformer's residual stream, float32 under autocast, stays float32
on the next stage as on one process, rounded once at the cut, rather than being added to in bf16 there.

bf16 is not free of cost in accuracy, here as on one process: see docs/benchmarks.md for the measured
loss curves of the main job's models against float32.

bf16 is faster where the hardware multiplies bf16 natively (GPUs since Ampere; CPUs with AVX512-BF16 or
AMX, Intel Cooper Lake and Sapphire Rapids on: ``lscpu | grep -o 'avx512_bf16\\|amx_bf16'`` says) and
the products are large enough to be bound by arithmetic, not by reading the weights. Elsewhere autocast
only adds conversions and runs slower than float32.
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
