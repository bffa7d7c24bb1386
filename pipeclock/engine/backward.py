"""Backward in two halves: B (the input's gradient) and W (the weights' gradients).

A stage's backward computes two things: the gradient of its input, which the previous stage waits for,
and the gradients of its weights, which nobody needs before the optimizer step. Zero-bubble schedules
run B at once and defer W into time that would otherwise be idle; the other schedules run W right after
B. Either way the work is the same, done in two calls:

- During the forward, hooks capture the input and output of every module that holds parameters
  directly (each ``nn.Linear``, ``nn.LayerNorm`` ...).
- ``B`` asks autograd for the gradients of the stage input and of those outputs. Autograd then computes
  no weight gradient at all.
- ``W`` turns each captured output's gradient into its module's weight gradients. For ``nn.Linear``
  that is one matrix product accumulated straight into ``.grad`` (``grad.addmm_(g.T, x)``): no temporary
  gradient written and then added, which on a CPU saves a full pass over every weight matrix per
  micro-batch. Other modules back-propagate through autograd, only as far as their own parameters.

When every captured module is an ``nn.Linear``, W needs only each layer's input and output gradient, so
B lets autograd free the graph; otherwise the graph is kept until W.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Captured:
    """A parameter-holding module's input and output in one forward."""

    module: nn.Module
    input: torch.Tensor | None  # kept for nn.Linear, whose weight gradient is computed here
    output: torch.Tensor
    version: int  # autograd's version counter when captured: an in-place change afterwards is an error


@dataclass
class WeightWork:
    """What W needs for one module: its captured forward and the gradient of its output."""

    captured: Captured
    grad: torch.Tensor


class ParameterOutputs:
    """Forward hooks on every module of ``modules`` that holds parameters directly."""

    def __init__(self, modules: Iterable[nn.Module]):
        self._captured: list[Captured] | None = None
        self.keeps_graph = False  # True when some module's W must go back through autograd
        for top in modules:
            for module in top.modules():
                if any(p.requires_grad for p in module.parameters(recurse=False)):
                    module.register_forward_hook(self._hook)
                    self.keeps_graph |= not isinstance(module, nn.Linear)

    def _hook(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._captured is None:
            return
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"the split backward needs every module with parameters to return one tensor; "
                f"{type(module).__name__} returned {type(output).__name__}"
            )
        linear_input = args[0].detach() if isinstance(module, nn.Linear) else None
        self._captured.append(Captured(module, linear_input, output, output._version))

    @contextmanager
    def capture(self) -> Iterator[list[Captured]]:
        """Collect the inputs and outputs of the parameter-holding modules run inside the block."""
        self._captured = captured = []
        try:
            yield captured
        finally:
            self._captured = None


def modified_in_place(captured: list[Captured]) -> Captured | None:
    """The first captured output changed in place after its module ran (by ``ReLU(inplace=True)``, say).

    Autograd can no longer give that output's own gradient, so its weights cannot be split off.
    """
    return next((item for item in captured if item.output._version != item.version), None)


def _zeros_for_unused(grads, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A stage input the stage did not use still gets a gradient: zeros, so every sender agrees."""
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)]


def gradient_roots(
    outputs: list[torch.Tensor], received: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs a backward starts from, with their received gradients: those in the graph.

    Every floating output leaf got a gradient from the next stage; one that needs none (computed
    without parameters or inputs, say) is not a root.
    """
    pairs = [(out, g) for out, g in zip(outputs, received, strict=True) if out.requires_grad]
    return [out for out, _ in pairs], [g for _, g in pairs]


def backward_whole(
    roots: list[torch.Tensor], grads: list[torch.Tensor] | None, inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Plain autograd backward through the stage (every ``.grad`` accumulated); the inputs' gradients."""
    if roots:
        torch.autograd.backward(roots, grads)
    return _zeros_for_unused([x.grad for x in inputs], inputs)


def backward_input(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    inputs: list[torch.Tensor],
    captured: list[Captured],
    keep_graph: bool,
) -> tuple[list[torch.Tensor], list[WeightWork]]:
    """``B``: the stage inputs' gradients, and the work ``W`` needs to finish the weights.

    ``roots`` are the stage's outputs that carry a gradient (or its loss on the last stage) and
    ``grads`` their received gradients (None for the loss); ``inputs`` the received leaves that want one.
    """
    changed = modified_in_place(captured)
    if changed is not None:
        raise RuntimeError(
            f"the output of {type(changed.module).__name__} was modified in place after the forward; "
            "a split backward (I, W) cannot recover its gradient (avoid inplace=True right after it)"
        )
    targets = inputs + [item.output for item in captured]
    if not targets or not roots:
        return _zeros_for_unused([None] * len(inputs), inputs), []
    found = torch.autograd.grad(roots, targets, grads, retain_graph=keep_graph, allow_unused=True)
    input_grads, output_grads = found[: len(inputs)], found[len(inputs) :]
    work = [WeightWork(c, g) for c, g in zip(captured, output_grads, strict=True) if g is not None]
    return _zeros_for_unused(input_grads, inputs), work


def backward_weight(work: list[WeightWork]) -> None:
    """``W``: accumulate each captured module's parameter gradients from its output's gradient."""
    for item in work:
        if item.captured.input is not None:
            _linear_weight_grad(item.captured.module, item.captured.input, item.grad)
        else:
            params = [p for p in item.captured.module.parameters(recurse=False) if p.requires_grad]
            torch.autograd.backward(item.captured.output, item.grad, inputs=params)


def _linear_weight_grad(linear: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor) -> None:
    """weight.grad += grad_out^T x and bias.grad += sum(grad_out), in place, over all leading dims."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
    weight, bias = linear.weight, linear.bias
    if weight.requires_grad:
        if weight.grad is None:
            weight.grad = g2.t().mm(x2)
        else:
            weight.grad.addmm_(g2.t(), x2)  # the product lands in .grad: no temporary to add
    if bias is not None and bias.requires_grad:
        summed = g2.sum(0)
        if bias.grad is None:
            bias.grad = summed
        else:
            bias.grad.add_(summed)


def held_tensors(work: list[WeightWork]) -> list[torch.Tensor]:
    """The tensors W keeps alive between B and W (what the activation meter counts then)."""
    return [t for item in work for t in (item.captured.input, item.grad) if t is not None]
