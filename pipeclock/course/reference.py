"""What the one-process model computes for one case of ``lab N --check``: the numbers a loop is held to.

Every stage boundary's activation and gradient per micro-batch, the parameters' gradients (whole, and
each micro-batch's share), and the loss. Every rank computes it itself: the model is small, and no
message is needed to know it. `which` names the micro-batch a tensor belongs to, so that a message or a
forward's input that is right for another micro-batch is said to be that one's, not merely "wrong".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeclock import schedule
from pipeclock.course.recorder import ACTIVATION, GRADIENT
from pipeclock.model import ShardedMLP

TOLERANCE = 1e-5  # relative to the largest value of the tensor compared


@dataclass(frozen=True)
class Case:
    """One step to check: ``m`` micro-batches on a model of ``layers`` x ``hidden``, a batch of ``batch``."""

    m: int
    hidden: int = 8
    layers: int = 8
    batch: int = 11


def batch_of(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case.m * 7919 + case.batch)
    return torch.randn(case.batch, case.hidden, generator=generator), torch.randn(
        case.batch, case.hidden, generator=generator
    )


def gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.detach().float() - want).abs().max().item()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and gap(got, want) <= TOLERANCE * max(want.abs().max().item(), 1e-6)


class Reference:
    """The one-process model's numbers for ``case`` cut into ``stages`` virtual stages."""

    def __init__(self, case: Case, stages: int, seed: int = 0) -> None:
        self.case = case
        self.inputs, self.targets = batch_of(case)
        whole = ShardedMLP(case.hidden, case.layers, 0, 1, seed)
        loss = F.mse_loss(whole(self.inputs), self.targets)
        loss.backward()
        self.loss = loss.item()
        self.grads = {name: p.grad.clone() for name, p in whole.named_parameters()}
        self.sent: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, micro-batch, stage it leaves)
        self.entering: dict[tuple[int, int], torch.Tensor] = {}  # (micro-batch, stage): a forward's input
        self.shares: list[dict[str, torch.Tensor]] = []
        parts = [ShardedMLP(case.hidden, case.layers, s, stages, seed) for s in range(stages)]
        pieces = zip(*(schedule.split_microbatches(t, case.m) for t in batch_of(case)), strict=True)
        for i, (x, target) in enumerate(pieces):
            for part in parts:
                part.zero_grad()
            ins, h = [], x
            for stage, part in enumerate(parts):
                if stage > 0:
                    h.retain_grad()  # the gradient a stage sends back: the one of its input
                ins.append(h)
                self.entering[i, stage] = h.detach()
                h = part(h)
                self.sent[ACTIVATION, i, stage] = h.detach()
            (F.mse_loss(h, target) * len(target) / case.batch).backward()
            for stage in range(1, stages):
                self.sent[GRADIENT, i, stage] = ins[stage].grad
            self.shares.append({n: p.grad.clone() for part in parts for n, p in part.named_parameters()})

    def which(self, kind: str, stage: int, tensor: torch.Tensor) -> int | None:
        """The micro-batch whose ``kind`` leaving ``stage`` ``tensor`` is, or None."""
        return next((i for i in range(self.case.m) if close(tensor, self.sent[kind, i, stage])), None)

    def anywhere(self, kind: str, tensor: torch.Tensor) -> tuple[int, int] | None:
        """The (micro-batch, stage) whose ``kind`` leaving that stage ``tensor`` is, at any stage, or None."""
        found = (key for key, sent in self.sent.items() if key[0] == kind and close(tensor, sent))
        return next(((i, stage) for _, i, stage in found), None)

    def entering_which(self, stage: int, tensor: torch.Tensor) -> int | None:
        """The micro-batch whose input to ``stage`` ``tensor`` is, or None."""
        return next((i for i in range(self.case.m) if close(tensor, self.entering[i, stage])), None)
