"""Tokens to the rank that holds their expert and the results back: two all-to-alls per MoE layer.

A family's experts module is called as ``experts(hidden (T, H), top_k_index (T, K), top_k_weights (T, K))``
with the router's global expert ids. With expert parallel each rank of an ep group holds a contiguous
block of ``local`` experts (rank r: ``r * local ... (r + 1) * local - 1``) and its own tokens. Every
(token, slot) pair is sorted by expert id, which groups the pairs by owner rank; the per-expert counts go
first (one small all-to-all, so that each receiver knows which of its experts each row is for), then the
rows. The owner runs its experts with the family's own forward, on local ids and unit weights; the
outputs go back by the reverse all-to-all, are put back in (token, slot) order and weighted by the
router's weights and summed over the slots on the sender, as the family does on one process.

Both all-to-alls are ``torch.distributed.all_to_all_single`` inside an autograd function whose backward is
the reverse all-to-all, so a token's gradient comes back to the rank it came from and each expert's weight
gradient holds the contributions of every replica's tokens. Every rank of the group takes part in every
exchange, forward and backward, even when it receives no row: its experts then run on one row of zeros
kept in the graph and return none, so that its backward (and its experts' zero gradient) still happens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.group = received, sent, group
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return back, None, None, None


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Each rank's ``(ep, local)`` count of rows it sends to each rank's experts, swapped: what it gets."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


def dispatched(
    experts: nn.Module,
    run_experts: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    group,
    ep: int,
) -> torch.Tensor:
    """The experts' weighted output for this rank's tokens, each computed on the rank holding its expert.

    ``run_experts(hidden, local_index, weights)`` is the family's experts forward over this rank's
    ``local`` experts (``experts.num_experts``).
    """
    local = experts.num_experts
    tokens, slots = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    rows = hidden[order // slots]
    counts = torch.bincount(expert_ids, minlength=local * ep).view(ep, local)
    got = exchange_counts(counts, group)
    sent, received = counts.sum(dim=1).tolist(), got.sum(dim=1).tolist()
    arrived = AllToAll.apply(rows, received, sent, group)
    local_ids = torch.arange(local, device=hidden.device).repeat(ep).repeat_interleave(got.reshape(-1))
    out = _run(run_experts, arrived, local_ids.unsqueeze(-1))
    back = AllToAll.apply(out, sent, received, group)
    per_slot = torch.empty_like(back)
    per_slot[order] = back
    per_slot = per_slot.view(tokens, slots, -1)
    return (per_slot * top_k_weights.unsqueeze(-1).to(per_slot.dtype)).sum(dim=1).to(hidden.dtype)


def _run(
    run_experts: Callable[..., torch.Tensor], rows: torch.Tensor, local_ids: torch.Tensor
) -> torch.Tensor:
    """The experts on the rows that arrived (unit weights: the sender applies the router's). With none,
    one row of zeros still goes through them and is dropped, so that the backward reaches this rank."""
    ones = torch.ones(local_ids.shape, dtype=rows.dtype, device=rows.device)
    if rows.shape[0]:
        return run_experts(rows, local_ids, ones)
    none = rows.sum(dim=0, keepdim=True)
    return run_experts(none, local_ids.new_zeros((1, 1)), ones.new_ones((1, 1)))[:0]
