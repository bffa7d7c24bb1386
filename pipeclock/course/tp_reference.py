"""What one process computes for ``pipeclock lab 12 --check``: an MLP's two Linears, whole, and how a
rank's share of them compares.

The MLP is ``down(relu(up(x)))`` with a mean-squared-error loss: ``up`` is what a column split cuts,
``down`` what a row split cuts. Its weights and biases (none zero, so that a bias added twice shows) come
from one seed, so every rank builds the same reference without a message. Every figure a learner's
split is held to is a slice of this one backward: the column split's output is ``h[:, rows]``, the row
split's input gradient ``a.grad[:, columns]``, and so on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, WIDTH, BATCH = 16, 64, 8  # the MLP 16 -> 64 -> 16: tp 2 and 4 divide both widths
TOLERANCE = 1e-5  # relative to the largest value of the tensor compared


class Reference:
    """The whole MLP's forward and backward on one process, every intermediate kept."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.up, self.down = _linear(HIDDEN, WIDTH, generator), _linear(WIDTH, HIDDEN, generator)
        self.x = torch.randn(BATCH, HIDDEN, generator=generator)
        self.target = torch.randn(BATCH, HIDDEN, generator=generator)
        x = self.x.clone().requires_grad_()
        self.h = self.up(x)  # what the column split computes, whole
        self.h.retain_grad()
        self.a = F.relu(self.h)  # what the row split takes, whole
        self.a.retain_grad()
        self.y = self.down(self.a)
        self.y.retain_grad()
        self.loss = F.mse_loss(self.y, self.target)
        self.loss.backward()
        self.x_grad = x.grad


def _linear(inputs: int, outputs: int, generator: torch.Generator) -> nn.Linear:
    layer = nn.Linear(inputs, outputs)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(outputs, inputs, generator=generator) / inputs**0.5)
        layer.bias.copy_(torch.rand(outputs, generator=generator) + 0.5)
    return layer


def share(size: int, rank: int, world: int) -> slice:
    """The indices rank ``rank`` of ``world`` keeps of ``size`` features: the rank-th equal part."""
    part = size // world
    return slice(rank * part, (rank + 1) * part)


def span(part: slice) -> str:
    return f"{part.start}-{part.stop - 1}"


def gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.detach().float() - want.detach()).abs().max().item()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape, and equal within `TOLERANCE` of the largest value of ``want``."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    return gap(got, want) <= TOLERANCE * max(want.abs().max().item(), 1e-6)


def how_far(got: torch.Tensor, want: torch.Tensor) -> str:
    """``differs ... by up to X (largest value Y)``, and the factor when the difference is a scale."""
    largest = want.abs().max().item()
    text = f"differs from one process's by up to {gap(got, want):.3g} (largest value {largest:.3g})"
    factor = scale(got, want)
    return text if factor is None else f"{text}: it is {factor:.4g} times the right one"


def scale(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The factor s with ``got == s * want``, when there is one other than 1."""
    denominator = (want * want).sum().item()
    if denominator == 0:
        return None
    factor = (got.detach().float() * want).sum().item() / denominator
    if abs(factor - 1) > 1e-3 and close(got, want * factor):
        return factor
    return None
