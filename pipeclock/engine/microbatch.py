"""Changing the loop from "batch" to "chunks": cutting a batch into micro-batches.

Sizes differ by at most one (the first ones get the extra samples), so any batch size works with any
micro-batch count up to the batch size. Each micro-batch's mean loss is weighted by its share of the
batch, which makes the sum over micro-batches exactly the full batch's mean loss, even for uneven splits.
"""

from __future__ import annotations

import torch


def microbatch_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """How many samples each of ``num_microbatches`` micro-batches gets (differ by at most one)."""
    if num_microbatches < 1:
        raise ValueError(f"the number of micro-batches must be >= 1, got {num_microbatches}")
    if batch_size < num_microbatches:
        raise ValueError(
            f"a batch of {batch_size} samples cannot be split into {num_microbatches} micro-batches "
            "(each needs at least one sample)"
        )
    base, extra = divmod(batch_size, num_microbatches)
    return [base + (1 if i < extra else 0) for i in range(num_microbatches)]


def split_microbatches(batch: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Split ``batch`` along its first dimension into ``n`` views whose sizes differ by at most one."""
    sizes = microbatch_sizes(batch.shape[0] if batch.dim() else 0, n)
    return list(torch.split(batch, sizes))


def loss_weights(sizes: list[int]) -> list[float]:
    """Each micro-batch's share of the batch: the weight of its mean loss in the batch's mean loss."""
    total = sum(sizes)
    return [size / total for size in sizes]
