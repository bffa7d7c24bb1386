"""Lab 12 exercise: a column-parallel and a row-parallel Linear, by hand.

Check it:  python -m pipeclock lab 12 --check labs/exercises/tensor_parallel.py
(the answer, when you want it: labs/solutions/tensor_parallel.py)

An ``nn.Linear`` computes ``y = x @ W.T + b``, with ``W`` of shape (out_features, in_features). Every
rank is given the same whole layer and keeps 1/world of it. The check runs your classes on 2 and on 4
real processes (one process group, ``torch.distributed``'s default) and compares the output, the
input's gradient and every weight's gradient with the whole layer's on one process.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need these)
import torch.nn.functional as F  # noqa: F401
from torch import nn


class SumGradientsOverRanks(torch.autograd.Function):
    """Forward: the input unchanged. Backward: the gradient summed over the ranks (``dist.all_reduce``,
    which sums in place: do it on a copy)."""

    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("write the forward of SumGradientsOverRanks")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("write the backward of SumGradientsOverRanks")


class SumOverRanks(torch.autograd.Function):
    """Forward: the sum over the ranks. Backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("write the forward of SumOverRanks")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("write the backward of SumOverRanks")


class ColumnParallelLinear(nn.Module):
    """Rank ``rank``'s share of ``layer``, split by its output features.

    Keep this rank's rows of the weight and of the bias (rank r of w keeps out_features / w of them, from
    r * out_features / w on) as ``self.weight`` and ``self.bias``, each an ``nn.Parameter``.
    Input: the whole input, the same on every rank. Output: this rank's output features. Each rank's
    backward gives only its own features' part of the input's gradient: sum them over the ranks.
    """

    def __init__(self, layer: nn.Linear, rank: int, world: int):
        super().__init__()
        raise NotImplementedError("keep this rank's rows of the weight and of the bias")

    def forward(self, x):
        raise NotImplementedError("write the column split's forward")


class RowParallelLinear(nn.Module):
    """Rank ``rank``'s share of ``layer``, split by its input features.

    Keep this rank's columns of the weight as ``self.weight`` and the whole bias as ``self.bias``, each an
    ``nn.Parameter``. Input: this rank's slice of the input features (what a column split before it
    outputs). Output: the whole output, the same on every rank: sum the ranks' partial products, then add
    the bias once.
    """

    def __init__(self, layer: nn.Linear, rank: int, world: int):
        super().__init__()
        raise NotImplementedError("keep this rank's columns of the weight, and the whole bias")

    def forward(self, x):
        raise NotImplementedError("write the row split's forward")
