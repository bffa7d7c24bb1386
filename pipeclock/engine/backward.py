"""Backward in two halves: B (the input's gradient) and W (the weights' gradients).

Zero-bubble schedules run B at once (the previous stage waits for it) and defer W into idle time. Hooks
capture the input and output of every module that holds parameters directly; ``B`` asks autograd only
for the stage input's and those outputs' gradients; ``W`` turns each output gradient into its module's
weight gradients (one ``addmm_`` into ``.grad`` for an ``nn.Linear``, autograd for the rest). A backward
that W follows at once is split only where that pays (``in_place_pays``), else it is one autograd call
with no hook. Inside a checkpointed block a block is rebuilt once per micro-batch, not once per call;
under autocast a weight gradient is computed as autograd would. A module whose weights cannot be left
to W (its output not one tensor, changed in place, never called (its weights read directly), or one of
its parameters held by another module too) has them computed by B, in the same autograd call. A Linear
split by tensor parallel (its weight a DTensor) gets its shard's gradient from this rank's own slices:
W sends nothing. Why, in
detail: docs/engine.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.distributed.tensor import DTensor

from pipeclock.engine import rng


@dataclass(slots=True)
class Captured:
    """A parameter-holding module's input and output in one forward."""

    module: nn.Module
    input: torch.Tensor | None  # kept for nn.Linear, whose weight gradient is computed here
    output: torch.Tensor | None  # None inside a checkpoint, where only ``edge`` is kept
    version: int  # autograd's version counter when captured: an in-place change afterwards is an error
    edge: GradientEdge | None = None  # inside a checkpoint: where the output's gradient arrives
    rebuilt: Rebuilt | None = None  # inside a checkpoint, for a module other than nn.Linear
    in_input_backward: bool = False  # B computes this module's weight gradients (see the docstring)

    @property
    def gradient_target(self) -> torch.Tensor | GradientEdge:
        return self.output if self.output is not None else self.edge


@dataclass(slots=True)
class Rebuilt:
    """A module's inputs as a checkpoint's rebuild saw them, and the context to run it again in W."""

    args: tuple
    position: rng.Position
    autocast: tuple[str, torch.dtype] | None  # (device type, dtype) when autocast was on


@dataclass(slots=True)
class WeightWork:
    """What W needs for one module: its captured forward and the gradient of its output."""

    captured: Captured
    grad: torch.Tensor


def plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` computing ``x @ weight.T + bias`` from its first argument: W can take its weight
    gradient as one matrix product (a subclass with its own ``forward`` goes through autograd)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


# Weight elements per nn.Linear (on average) from which an in-place W pays for its Python per module.
# Measured on 2 CPU cores, a stack of Linear + ReLU, B then W against one autograd call, gradients
# accumulating: at width 128 the split gains nothing, at 256 it is 5-20 % faster, at 1024 up to 45 %.
IN_PLACE_PAYS_FROM = 2**15


def in_place_pays(owners: Sequence[nn.Module]) -> bool:
    """True when splitting a backward that W follows at once saves time: ``owners`` (the modules that
    hold parameters directly) are all ``nn.Linear`` and their weights are large enough."""
    if not owners or not all(plain_linear(m) for m in owners):
        return False
    return sum(_local(m.weight).numel() for m in owners) >= IN_PLACE_PAYS_FROM * len(owners)


# An in-place W saves, per module, a temporary the size of its weight; it costs holding every module's
# output gradient (rows x outputs) from B until W. Measured on 2 CPU cores, 2 ranks, GPipe, a stack of
# Linear + ReLU: at hidden 512 with 256 rows per micro-batch the split took 8 % more CPU than one autograd
# call (in page faults: the held gradients grow the heap); at 128 rows it was 3 % faster, at hidden 1024
# with 64 rows 7 %. The split pays while the weights are at least this many times the held gradients.
IN_PLACE_SAVES_FROM = 4


def in_place_saves_enough(captured: Sequence[Captured]) -> bool:
    """True when this micro-batch is small enough next to the weights for a split backward to pay.

    ``captured`` is one forward's capture; recomputed modules (no output kept) are not counted.
    """
    outputs = [item for item in captured if item.output is not None]
    weights = sum(_local(item.module.weight).numel() for item in outputs if plain_linear(item.module))
    return bool(outputs) and weights >= IN_PLACE_SAVES_FROM * sum(item.output.numel() for item in outputs)


class ParameterOutputs:
    """Forward hooks on every module of ``modules`` that holds parameters directly.

    ``recomputed``: the modules that run inside a checkpoint (``recompute.apply_recompute``).
    ``defers_weights``: some backward's W waits for a later action (an ``I``): every such module must
    then be captured. Otherwise the hooks are registered only when ``split_pays``.
    """

    def __init__(
        self, modules: Iterable[nn.Module], recomputed: Iterable[nn.Module] = (), defers_weights: bool = True
    ):
        self._captured: list[Captured] | None = None
        self._rebuilding: dict[nn.Module, deque[Captured]] | None = None
        self._recomputed = set(recomputed)
        modules = list(modules)
        self._owners = {
            id(top): [m for m in top.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
            for top in modules
        }
        owners = [module for top in modules for module in self._owners[id(top)]]
        self._sharing = _sharing_a_parameter(owners)
        # True when some module's W must go back through autograd
        self.keeps_graph = any(not plain_linear(m) and m not in self._recomputed for m in owners)
        self.split_pays = in_place_pays(owners)  # a backward W follows at once is better split
        self.defers_weights = defers_weights
        self.hooked = defers_weights or self.split_pays
        # forward input shapes -> whether a backward that W follows at once is split for them
        # (``in_place_saves_enough`` on their first forward); forwards that will not split capture nothing
        self.split_pays_for: dict[tuple, bool] = {}
        if self.hooked:
            for module in owners:
                module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._rebuilding is not None:
            pending = self._rebuilding.get(module)
            if pending:
                _collect_rebuilt(pending.popleft(), args)
            return
        if self._captured is None:
            return
        if not isinstance(output, torch.Tensor) or module in self._sharing:
            self._captured.append(Captured(module, None, None, 0, in_input_backward=True))
            return
        if not output.requires_grad:  # computed without a gradient (no_grad, or from nothing that needs one)
            return
        if module in self._recomputed:
            self._captured.append(Captured(module, None, None, 0, get_gradient_edge(output)))
            return
        linear_input = _local(args[0]).detach() if plain_linear(module) else None
        self._captured.append(Captured(module, linear_input, output, output._version))

    @contextmanager
    def capture(self, shape: tuple | None = None, chunk: nn.Module | None = None) -> Iterator[list[Captured]]:
        """Collect the inputs and outputs of the parameter-holding modules run inside the block.

        ``shape`` (what the forward was fed; None when every W may be deferred) lets a forward whose
        backward is known to run whole collect nothing: holding every layer's output through the
        forward, only to drop it after, cost fresh memory (page faults) on every step. ``chunk`` (the
        module run): its parameter-holding modules that were not called get their weight gradients in B.
        """
        if shape is not None and self.split_pays_for.get(shape) is False:
            yield []
            return
        self._captured = captured = []
        try:
            yield captured
            called = {id(item.module) for item in captured}
            for module in self._owners.get(id(chunk), []):
                if id(module) not in called:
                    captured.append(Captured(module, None, None, 0, in_input_backward=True))
        finally:
            self._captured = None

    def kept(self, shape: tuple | None, captured: list[Captured]) -> list[Captured]:
        """What a forward's backward will use of ``captured``: all of it when W may be deferred
        (``shape`` None), else all or nothing, as ``in_place_saves_enough`` decides on the first
        forward of each shape."""
        if shape is None:
            return captured
        if shape not in self.split_pays_for:
            self.split_pays_for[shape] = in_place_saves_enough(captured)
        return captured if self.split_pays_for[shape] else []

    @contextmanager
    def rebuilding(self, captured: list[Captured]) -> Iterator[None]:
        """Around B: checkpoints rebuilding their blocks hand the inputs of ``captured``'s modules over."""
        pending: dict[nn.Module, deque[Captured]] = {}
        for item in captured:
            if item.edge is not None:
                pending.setdefault(item.module, deque()).append(item)
        self._rebuilding = pending
        try:
            yield
        finally:
            self._rebuilding = None


def _sharing_a_parameter(owners: list[nn.Module]) -> set[nn.Module]:
    """The modules holding a parameter that another module holds too (BERT's decoder bias): each W
    would add its gradient, so B takes it, once."""
    holders: dict[int, list[nn.Module]] = {}
    for module in owners:
        for parameter in module.parameters(recurse=False):
            holders.setdefault(id(parameter), []).append(module)
    return {module for found in holders.values() if len(found) > 1 for module in found}


def _collect_rebuilt(item: Captured, args: tuple) -> None:
    if plain_linear(item.module):
        item.input = _local(args[0]).detach()
        return
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    device = next((a.device.type for a in detached if isinstance(a, torch.Tensor)), "cpu")
    autocast = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
    item.rebuilt = Rebuilt(detached, rng.current(), autocast)


def nothing_to_accumulate(captured: list[Captured]) -> bool:
    """True when no captured module's parameter holds a gradient yet (the step's first backward through
    the chunk, after ``zero_grad(set_to_none=True)``).

    W's in-place product saves a pass over a weight gradient only when there is one to add to; here
    autograd keeps the gradient it computes as ``.grad`` without a copy, so one autograd call does the
    same arithmetic without W's Python per module.
    """
    return all(p.grad is None for item in captured for p in item.module.parameters(recurse=False))


def modified_in_place(captured: list[Captured]) -> Captured | None:
    """The first captured output changed in place after its module ran (by ``ReLU(inplace=True)``, say).

    Autograd can no longer give that output's own gradient, so its weights cannot be split off.
    """
    return next(
        (item for item in captured if item.output is not None and item.output._version != item.version), None
    )


def _weights_in_input_backward(captured: list[Captured]) -> tuple[list[Captured], list[nn.Parameter]]:
    """The captured modules whose weights W can take, and the parameters B must take itself."""
    split, whole = [], []
    for item in captured:
        changed = item.output is not None and item.output._version != item.version
        if item.in_input_backward or changed:
            whole += _own_parameters(item.module)
        else:
            split.append(item)
    return split, list({id(p): p for p in whole}.values())


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
    # a gradient may travel in a narrower dtype than its output (bf16 messages)
    return [out for out, _ in pairs], [g.to(out.dtype) for out, g in pairs]


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
    captured, whole = _weights_in_input_backward(captured)
    targets = inputs + [item.gradient_target for item in captured] + whole
    if not targets or not roots:
        return _zeros_for_unused([None] * len(inputs), inputs), []
    found = torch.autograd.grad(roots, targets, grads, retain_graph=keep_graph, allow_unused=True)
    input_grads = found[: len(inputs)]
    output_grads = found[len(inputs) : len(inputs) + len(captured)]
    _accumulate_each(whole, found[len(inputs) + len(captured) :])
    work = [WeightWork(c, g) for c, g in zip(captured, output_grads, strict=True) if g is not None]
    return _zeros_for_unused(input_grads, inputs), work


def _accumulate_each(parameters: list[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    for parameter, grad in zip(parameters, grads, strict=True):
        if grad is None:
            continue
        if parameter.grad is None:
            parameter.grad = grad
        else:
            parameter.grad.add_(grad)


def backward_weight(work: list[WeightWork]) -> None:
    """``W``: accumulate each captured module's parameter gradients from its output's gradient."""
    not_rebuilt = []
    for item in work:
        captured = item.captured
        if captured.input is not None:
            _linear_weight_grad(captured.module, captured.input, item.grad)
        elif captured.rebuilt is not None:
            _rebuilt_weight_grad(captured.module, captured.rebuilt, item.grad)
        elif captured.output is not None:
            params = [p for p in captured.module.parameters(recurse=False) if p.requires_grad]
            # the graph may be shared with another module's W (a module inside this one's computation)
            torch.autograd.backward(captured.output, item.grad, inputs=params, retain_graph=True)
        else:
            not_rebuilt.append(item)
    if not_rebuilt:
        _weight_grads_by_rebuilding(not_rebuilt)


def _weight_grads_by_rebuilding(work: list[WeightWork]) -> None:
    """W for checkpointed modules that B never had to rebuild (nothing before them needs a gradient, as
    at the start of the first stage): one autograd call from their output edges rebuilds them now.
    """
    params = list({id(p): p for item in work for p in _own_parameters(item.captured.module)}.values())
    edges = [item.captured.edge for item in work]
    found = torch.autograd.grad(edges, params, [item.grad for item in work], allow_unused=True)
    _accumulate_each(params, found)


def _own_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _rebuilt_weight_grad(module: nn.Module, rebuilt: Rebuilt, grad_out: torch.Tensor) -> None:
    """Run ``module`` alone on its rebuilt input (as its forward ran) and back-propagate to its parameters."""
    params = _own_parameters(module)
    cast = torch.autocast(rebuilt.autocast[0], rebuilt.autocast[1]) if rebuilt.autocast else nullcontext()
    with torch.enable_grad(), cast, rng.keyed(rebuilt.position.step, rebuilt.position.first_sample):
        output = module(*rebuilt.args)
    torch.autograd.backward(output, grad_out, inputs=params)


def _linear_weight_grad(linear: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor) -> None:
    """weight.grad += grad_out^T x and bias.grad += sum(grad_out), in place, over all leading dims.

    Under autocast the output gradient is in the compute dtype: the input is rounded to it as the forward
    rounded it, and the product is added to the float32 ``.grad``, as autograd does. A split weight
    (tensor parallel) gets this rank's shard: ``x`` and ``grad_out`` are then this rank's own tensors.
    """
    weight, bias = linear.weight, linear.bias
    x2 = _own_part(_as_matrix(x), weight, 1).to(grad_out.dtype)
    g2 = _own_part(_as_matrix(_local(grad_out)), weight, 0)
    if weight.requires_grad:
        _accumulate(weight, g2.t(), x2)
    if bias is not None and bias.requires_grad:
        _accumulate(bias, g2.sum(0))


def _accumulate(parameter: torch.Tensor, grad: torch.Tensor, times: torch.Tensor | None = None) -> None:
    """``parameter.grad += grad`` (``grad @ times`` when ``times`` is given), on this rank's shard of a
    split parameter; the product lands in an existing ``.grad`` of the same dtype without a temporary."""
    if parameter.grad is None:
        value = grad if times is None else grad.mm(times)
        parameter.grad = _like(parameter, value.to(parameter.dtype))
        return
    local = _local(parameter.grad)
    if times is None:
        local.add_(grad)
    elif grad.dtype == local.dtype:
        local.addmm_(grad, times)
    else:
        local.add_(grad.mm(times))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor split by tensor parallel (a DTensor); any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _own_part(t: torch.Tensor, weight: torch.Tensor, dim: int) -> torch.Tensor:
    """The columns of ``t`` that this rank's shard of ``weight`` meets along the weight's ``dim`` (0: its
    output features, 1: its input features): all of ``t`` unless the weight is split along ``dim`` and
    ``t`` is whole there (an output gathered after a column split, say). The split is even."""
    if not isinstance(weight, DTensor):
        return t
    size = weight.to_local().shape[dim]
    if t.shape[-1] == size:
        return t
    split = [i for i, p in enumerate(weight.placements) if p.is_shard(dim)]
    if len(split) != 1 or t.shape[-1] != weight.shape[dim]:
        raise RuntimeError(
            f"a split Linear's weight {tuple(weight.shape)} ({weight.placements}) does not meet "
            f"its {'output gradient' if dim == 0 else 'input'} of width {t.shape[-1]}"
        )
    start = weight.device_mesh.get_coordinate()[split[0]] * size
    return t[:, start : start + size]


def _like(parameter: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``parameter`` from this rank's part of it: split the same way as the parameter."""
    if not isinstance(parameter, DTensor):
        return local
    return DTensor.from_local(
        local, parameter.device_mesh, parameter.placements, run_check=False,
        shape=parameter.shape, stride=parameter.stride(),
    )  # fmt: skip


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    """All leading dims folded into rows (a 2-D tensor is returned as it is)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def held_tensors(work: list[WeightWork]) -> list[torch.Tensor]:
    """The tensors W keeps alive between B and W (what the activation meter counts then)."""
    held = [t for item in work for t in (item.captured.input, item.grad) if t is not None]
    rebuilt = [item.captured.rebuilt for item in work if item.captured.rebuilt is not None]
    return held + [a for r in rebuilt for a in r.args if isinstance(a, torch.Tensor)]
