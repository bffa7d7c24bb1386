"""A row split that sums with a bare dist.all_reduce in its forward, not in an autograd Function."""

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
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y + self.bias
