"""Backward, whole or split into B (input gradient) and W (weight gradient) for zero-bubble schedules.

A stage's backward computes two things: the gradient of its input (the previous stage waits for it) and
the gradients of its weights (nobody waits for them until the optimizer step). Zero-bubble schedules run
the first as ``B`` right away and defer the second as ``W`` into what would otherwise be idle time.

How the split works for any module: during the forward, hooks capture the output of every module that
holds parameters directly (each ``nn.Linear``, ``nn.LayerNorm`` ...). ``B`` asks autograd for the
gradients of the stage input *and of those outputs*, keeping the graph; autograd then computes no weight
gradient at all. ``W`` later takes each captured output with its gradient and back-propagates it only as
far as that module's own parameters: one small product per layer, the same arithmetic a whole backward
would have done.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class CapturedOutput:
    module: nn.Module
    output: torch.Tensor
    version: int  # autograd's version counter when captured: an in-place change afterwards is an error


WeightWork = list[tuple[nn.Module, torch.Tensor, torch.Tensor]]


def backward_whole(
    root: torch.Tensor, grad: torch.Tensor | None, stage_input: torch.Tensor
) -> torch.Tensor | None:
    """Backward through the stage, accumulating every ``.grad``; returns the input's gradient."""
    torch.autograd.backward(root, grad)
    return stage_input.grad if stage_input.requires_grad else None


class ParameterOutputs:
    """Forward hooks on every module of ``modules`` that holds parameters directly."""

    def __init__(self, modules: Iterable[nn.Module]):
        self._captured: list[CapturedOutput] | None = None
        for top in modules:
            for module in top.modules():
                if any(p.requires_grad for p in module.parameters(recurse=False)):
                    module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: object, output: object) -> None:
        if self._captured is None:
            return
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"split backward (zero-bubble) needs every module with parameters to return one tensor; "
                f"{type(module).__name__} returned {type(output).__name__}"
            )
        self._captured.append(CapturedOutput(module, output, output._version))

    @contextmanager
    def capture(self) -> Iterator[list[CapturedOutput]]:
        """Collect the outputs of the parameter-holding modules run inside the block."""
        self._captured = captured = []
        try:
            yield captured
        finally:
            self._captured = None


def backward_input(
    root: torch.Tensor, grad: torch.Tensor | None, stage_input: torch.Tensor, captured: list[CapturedOutput]
) -> tuple[torch.Tensor | None, WeightWork]:
    """``B``: the stage input's gradient now, and what ``W`` needs to finish the weights later."""
    for item in captured:
        if item.output._version != item.version:
            raise RuntimeError(
                f"the output of {type(item.module).__name__} was modified in place after the forward; "
                "split backward (zero-bubble) cannot recover its gradient (avoid inplace=True there)"
            )
    wants_input = stage_input.requires_grad
    targets = ([stage_input] if wants_input else []) + [item.output for item in captured]
    if not targets:
        return None, []
    grads = torch.autograd.grad(root, targets, grad, retain_graph=True, allow_unused=True)
    input_grad = grads[0] if wants_input else None
    outputs_grads = grads[1:] if wants_input else grads
    work = [(c.module, c.output, g) for c, g in zip(captured, outputs_grads, strict=True) if g is not None]
    return input_grad, work


def backward_weight(work: WeightWork) -> None:
    """``W``: accumulate each captured module's parameter gradients from its output's gradient."""
    for module, output, grad in work:
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        torch.autograd.backward(output, grad, inputs=params)
