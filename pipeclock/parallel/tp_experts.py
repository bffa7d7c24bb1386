"""A mixture of experts split by tensor parallel: ``transformers``' ``moe_tp_experts`` and its weights.

``transformers`` keeps a layer's experts in one module with 3-d weights (``@use_experts_implementation``):
``gate_up_proj`` ``[experts, 2 * inter, hidden]`` (gate and up stacked; ``[experts, hidden, 2 * inter]``
when transposed) and ``down_proj`` ``[experts, hidden, inter]``. Its plan names the module
``moe_tp_experts`` and each weight by the Linear its slice of an expert acts as: ``packed_colwise`` (the
output features split, each half alike), ``rowwise`` (the input features split), or their transposed
counterparts (``packed_rowwise``, ``colwise``). Split so, every rank runs every expert on its share of
the intermediate features; the output is each rank's partial sum, added over tp.

Each weight stays one DTensor with public placements (``Shard``): a packed weight is held viewed as
``[..., 2, inter, ...]`` with the ``inter`` dim split, so each rank keeps its slice of the gate and the
same slice of the up (a plain split of the stacked dim would give one rank all the gates). In the
module's forward its code reads each weight as this rank's local tensor, in ``transformers``' own shape;
the inputs (tokens, routing weights) enter as whole tensors whose gradients are summed over tp, and the
output leaves summed (DTensor's ``Partial`` made ``Replicate``: one all-reduce each way).

What does not fit (a bias added after the row split, a norm after each expert, weights not in this
layout) is refused in one line, naming the module, before anything is split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

EXPERTS = "moe_tp_experts"
# a weight style of transformers' expert plans -> the Linear dim it splits (-2 output, -1 input)
WEIGHT_STYLES = {"packed_colwise": -2, "colwise": -2, "packed_rowwise": -1, "rowwise": -1}


@dataclass(frozen=True)
class Weight:
    """How one of the experts' weights is held: the dim split, and whether it is two stacked halves."""

    name: str
    dim: int  # negative: counted from the end, as in transformers' shape
    packed: bool

    def held(self, whole: torch.Tensor) -> torch.Tensor:
        """The whole weight as the DTensor holds it (a packed dim viewed as ``2, inter``)."""
        if not self.packed:
            return whole
        shape = list(whole.shape)
        at = whole.dim() + self.dim
        return whole.reshape(*shape[:at], 2, shape[at] // 2, *shape[at + 1 :])

    def placement(self, ndim: int) -> Shard:
        return Shard(ndim + self.dim + (1 if self.packed else 0))

    def local(self, parameter: DTensor) -> torch.Tensor:
        """This rank's slice, in ``transformers``' shape (the halves stacked again): what the code reads."""
        local = parameter.to_local()
        if not self.packed:
            return local
        at = local.dim() + self.dim
        return local.flatten(at - 1, at)


def weight_styles(plan: dict[str, str]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The plan without the experts' weight patterns, and each experts pattern's weights and styles.

    A weight pattern is one whose parent pattern is ``moe_tp_experts``: it names a parameter, not a module.
    """
    experts = {p: {} for p, style in plan.items() if style == EXPERTS}
    rest = {}
    for pattern, style in plan.items():
        parent, _, leaf = pattern.rpartition(".")
        if parent in experts and style in WEIGHT_STYLES:
            experts[parent][leaf] = style
        else:
            rest[pattern] = style
    return rest, experts


def layout(module: nn.Module, styles: dict[str, str], tp: int, name: str) -> list[Weight] | str:
    """How each of ``module``'s weights is split, or why it cannot be (one line naming ``name``)."""
    if not hasattr(module, "is_transposed") or not hasattr(module, "has_gate"):
        return (
            f"{name} ({EXPERTS}) is a {type(module).__name__}, not transformers' experts module with "
            "stacked 3-d weights: pipeclock splits only those"
        )
    if getattr(module, "has_bias", False):
        return f"{name} ({EXPERTS}) has biases, which a row split would add once per rank: train without --tp"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name} ({EXPERTS}) normalises each expert's output, which a row split leaves in parts"
    own = dict(module.named_parameters(recurse=False))
    left = sorted(set(own) - set(styles))
    if left or not styles:
        return f"{name} ({EXPERTS}): the plan does not say how to split {', '.join(left) or 'its weights'}"
    transposed = bool(module.is_transposed)
    weights = []
    for key, style in styles.items():
        if key not in own:
            return f"{name} ({EXPERTS}) has no weight {key} (the plan splits {name}.{key} {style})"
        weight = own[key]
        first = key != "down_proj"  # the projection in (gate and up, or up alone); down_proj out
        dim = WEIGHT_STYLES[style]
        expected = (-1 if transposed else -2) if first else (-2 if transposed else -1)
        if weight.dim() != 3 or dim != expected:
            return (
                f"{name}.{key} is split {style} (dim {dim}), which does not fit its "
                f"{'transposed ' if transposed else ''}layout {list(weight.shape)}"
            )
        packed = first and _stacked(module)
        size = weight.shape[dim] // (2 if packed else 1)
        if size % tp:
            return f"--tp {tp} does not divide the {size} intermediate features of {name}.{key} ({style})"
        weights.append(Weight(key, dim, packed))
    return weights


def _stacked(module: nn.Module) -> bool:
    return bool(getattr(module, "has_gate", False)) and bool(getattr(module, "is_concatenated", True))


def stacked_weights(modules: list[nn.Module]) -> dict[str, Weight]:
    """Every gate-and-up weight of transformers' experts modules in ``modules``, by parameter name.

    Checkpoints hold each one as the split holds it, ``[..., 2, inter, ...]``, whatever the tp: one
    layout on disk that any tp reads its shards of (a split of the stacked dim would not be one).
    """
    found = {}
    for root in modules:
        for name, module in root.named_modules():
            weight = getattr(module, "gate_up_proj", None)
            if hasattr(module, "is_transposed") and _stacked(module) and isinstance(weight, nn.Parameter):
                dim = -1 if module.is_transposed else -2
                found[f"{name}.gate_up_proj" if name else "gate_up_proj"] = Weight("gate_up_proj", dim, True)
    return found


class ExpertsParallel(ParallelStyle):
    """``moe_tp_experts``: the experts' weights split by `Weight`, the output summed over tp."""

    def __init__(self, weights: list[Weight]):
        super().__init__()
        self.weights = weights

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for weight in self.weights:
            whole = getattr(module, weight.name)
            held = weight.held(whole.detach())
            shard = distribute_tensor(held, device_mesh, [weight.placement(whole.dim())])
            module.register_parameter(weight.name, nn.Parameter(shard, requires_grad=whole.requires_grad))
        module.register_forward_pre_hook(_Enter(self.weights, device_mesh), with_kwargs=True)
        module.register_forward_hook(_Leave(self.weights, device_mesh), always_call=True)
        return module


class _Enter:
    """Before the forward: the code's weights are this rank's slices; float inputs summed in backward."""

    def __init__(self, weights: list[Weight], mesh: DeviceMesh):
        self.weights, self.mesh = weights, mesh

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        held = dict(module.named_parameters(recurse=False))
        for weight in self.weights:
            # the instance's own attribute is found before the module's parameter of the same name
            object.__setattr__(module, weight.name, weight.local(held[weight.name]))
        args = tuple(self._summed_in_backward(a) for a in args)
        kwargs = {k: self._summed_in_backward(v) for k, v in kwargs.items()}
        return args, kwargs

    def _summed_in_backward(self, value):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or isinstance(value, DTensor):
            return value
        whole = DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
        return whole.to_local(grad_placements=[Partial()])


class _Leave:
    """After the forward: the weights read as parameters again, and the output summed over tp."""

    def __init__(self, weights: list[Weight], mesh: DeviceMesh):
        self.weights, self.mesh = weights, mesh

    def __call__(self, module: nn.Module, args, output):
        for weight in self.weights:
            module.__dict__.pop(weight.name, None)
        if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
            parts = DTensor.from_local(output, self.mesh, [Partial()], run_check=False)
            return parts.redistribute(self.mesh, [Replicate()]).to_local()
        return output
