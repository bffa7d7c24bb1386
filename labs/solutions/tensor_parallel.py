"""Tensor parallel by hand: a Linear split by its outputs (column) and one split by its inputs (row).

An ``nn.Linear`` computes ``y = x @ W.T + b`` with ``W`` of shape (out_features, in_features). Split over
``world`` ranks, each keeps 1/world of ``W``:

- **column split**: rows of ``W`` (and of ``b``), so each rank computes *its own output features*, whole.
  The input must be whole on every rank. Backward, each rank holds only its features' part of the
  input's gradient: the parts are summed over the ranks (all-reduce).
- **row split**: columns of ``W``, so each rank multiplies *its own slice of the input features* and gets
  a partial product of every output feature; the partial products are summed over the ranks
  (all-reduce) and the bias is added once. Backward, the output's gradient is already whole on every
  rank: it goes through the sum unchanged.

A column split followed by a row split (an MLP's two layers) needs one all-reduce forward and one
backward: the column's output slice is exactly the row's input slice. The two all-reduces are each
other's mirror, written below as two ``torch.autograd.Function``s: one sums forward and passes the
gradient back as it is, the other passes forward as it is and sums the gradient.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class SumGradientsOverRanks(torch.autograd.Function):
    """Forward: the input unchanged. Backward: the gradient summed over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # all_reduce works in place: never on a tensor autograd may still use
        dist.all_reduce(grad)
        return grad


class SumOverRanks(torch.autograd.Function):
    """Forward: the sum over the ranks. Backward: the gradient unchanged (it is whole on every rank)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def my_share(size: int, rank: int, world: int) -> slice:
    """The indices rank ``rank`` keeps of ``size`` split in ``world`` equal parts."""
    assert size % world == 0, f"{world} ranks do not divide {size} features"
    part = size // world
    return slice(rank * part, (rank + 1) * part)


class ColumnParallelLinear(nn.Module):
    """Rank ``rank``'s share of ``layer``: its output features (rows of the weight, and of the bias).

    Input: the whole input, on every rank. Output: this rank's out_features / world features."""

    def __init__(self, layer: nn.Linear, rank: int, world: int):
        super().__init__()
        rows = my_share(layer.out_features, rank, world)
        self.weight = nn.Parameter(layer.weight.detach()[rows].clone())
        self.bias = nn.Parameter(layer.bias.detach()[rows].clone())

    def forward(self, x):
        return F.linear(SumGradientsOverRanks.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank ``rank``'s share of ``layer``: its input features (columns of the weight); the bias whole.

    Input: this rank's in_features / world features. Output: the whole output, on every rank."""

    def __init__(self, layer: nn.Linear, rank: int, world: int):
        super().__init__()
        columns = my_share(layer.in_features, rank, world)
        self.weight = nn.Parameter(layer.weight.detach()[:, columns].clone())
        self.bias = nn.Parameter(layer.bias.detach().clone())

    def forward(self, x):
        return SumOverRanks.apply(F.linear(x, self.weight)) + self.bias
