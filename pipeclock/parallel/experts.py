"""Expert parallel: each MoE layer's experts divided over ``ep`` ranks carved from a stage's dp ranks.

As in Megatron-Core and torchtitan, ep divides dp: the dp ranks of one (stage, tp rank) form a
``(dp / ep, ep)`` grid, ``edp`` by ``ep``, replica ``d`` at ``(d // ep, d % ep)``. The ``ep`` ranks of a
row hold one expert block each (rank ``e``: experts ``e * E/ep`` to ``(e + 1) * E/ep - 1``) and trade
their tokens by all-to-all (`expert_dispatch`); the ``edp`` ranks of a column hold the same block. Every
other weight stays a dp replica as before (FSDP2 leaves the experts out: ``ignored_params``).

The plan is ``transformers``' ``base_model_ep_plan`` (or ``--ep-plan FILE``, the same JSON): modules named
``ep_dispatch_experts`` are the experts containers whose forward becomes the dispatch, and their
parameters named ``grouped_gemm`` are the fused expert weights, split along dim 0 (the expert). Each split
weight becomes a DTensor over the ``("edp", "ep")`` mesh, ``(Replicate(), Shard(0))``: checkpoints
store it whole under its HF name, and any ep (or none) reads it back.

Gradients: each replica's loss is already weighted by its share of the global batch, and the
all-to-all's backward brings every ep rank's tokens' gradients to the rank holding their expert, so an
expert's gradient on one rank is its ep row's whole contribution; the ``edp`` ranks holding the same
block then sum theirs (a sum, not a mean, as the dp engines do). With dp == ep there is nothing to sum.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from pipeclock import comms
from pipeclock.parallel.expert_dispatch import dispatched
from pipeclock.parallel.tensor_parallel import matches

DISPATCH, SPLIT = "ep_dispatch_experts", "grouped_gemm"
STYLES = (DISPATCH, SPLIT)
EXPERT_DIMS = ("edp", "ep")


def read_plan(path: str | Path) -> dict[str, str]:
    """An ep plan from a JSON file (``--ep-plan FILE``): module or parameter patterns to style names."""
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"--ep-plan {path}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--ep-plan {path}: not JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(plan, dict) or not plan or not all(isinstance(v, str) for v in plan.values()):
        raise ValueError(
            f"--ep-plan {path}: expected a JSON object of patterns and style names, "
            '{"layers.*.mlp.experts": "ep_dispatch_experts", '
            '"layers.*.mlp.experts.down_proj": "grouped_gemm", ...}'
        )
    return plan


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """This rank's ``("edp", "ep")`` mesh, carved from the dp ranks of its (stage, tp rank); every rank
    calls it, together (each creates every group, in one order, with the run's timeout)."""
    layout = mesh.mesh  # (dp, pp, tp) global ranks
    dp, pp, tp = layout.shape
    if ep < 1 or dp % ep:
        raise ValueError(
            f"rank {comms.get_rank()}: --ep {ep} does not divide --dp {dp} (ep is carved from dp)"
        )
    rank, timeout = comms.get_rank(), datetime.timedelta(seconds=comms.timeout())
    grids = [layout[:, s, t].reshape(dp // ep, ep) for s in range(pp) for t in range(tp)]
    mine = next(grid for grid in grids if (grid == rank).any())
    groups: dict[str, dist.ProcessGroup] = {}
    for dim, name in ((0, "edp"), (1, "ep")):
        for grid in grids:
            for ranks in grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist():
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    groups[name] = group
    return DeviceMesh.from_group(
        [groups["edp"], groups["ep"]], comms.device().type, mine, mesh_dim_names=EXPERT_DIMS
    )


@dataclass
class ExpertLayer:
    """One experts container the plan names, and its weights split by expert."""

    chunk: int
    name: str
    module: nn.Module
    weights: list[str] = field(default_factory=list)


def _resolve(chunks: Sequence[nn.Module], plan: Mapping[str, str]) -> tuple[list[ExpertLayer], set[str]]:
    """The experts containers of the chunks, their split weights, and the patterns that named something."""
    layers, used = [], set()
    for index, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            named = [p for p in plan if name and plan[p] == DISPATCH and matches(p, name)]
            if not named:
                continue
            used.update(named)
            layer = ExpertLayer(index, name, module)
            for weight, _ in module.named_parameters(recurse=False):
                split = [p for p in plan if plan[p] == SPLIT and matches(p, f"{name}.{weight}")]
                used.update(split)
                if split:
                    layer.weights.append(weight)
            layers.append(layer)
    return layers, used


def _problem(layer: ExpertLayer, ep: int, source: str) -> str | None:
    """What stops this layer's experts from being divided over ``ep`` ranks, or None."""
    count = getattr(layer.module, "num_experts", None)
    if not isinstance(count, int):
        return (
            f"{source} names {layer.name} ({DISPATCH}), a {type(layer.module).__name__} with no num_experts"
        )
    whole = [w for w, _ in layer.module.named_parameters(recurse=False) if w not in layer.weights]
    if whole:
        return f"{source} leaves {layer.name}.{whole[0]} unsplit ({SPLIT}): each rank holds only its experts"
    for weight in layer.weights:
        shape = list(getattr(layer.module, weight).shape)
        if not shape or shape[0] != count:
            return f"{layer.name}.{weight} {shape} is not one slice per expert ({count} experts)"
    if count % ep:
        return f"--ep {ep} does not divide the {count} experts of {layer.name}"
    return None


def check_plan(
    chunks: Sequence[nn.Module], plan: Mapping[str, str], ep: int, source: str
) -> list[ExpertLayer]:
    """The plan checked on every rank alike (one gather): styles known, every pattern naming something on
    some stage, every experts container divisible by ``ep``. Returns this rank's expert layers."""
    rank = comms.get_rank()
    unknown = next((f"{p} ({s})" for p, s in plan.items() if s not in STYLES), None)
    if unknown:
        raise ValueError(
            f"rank {rank}: {source} asks for {unknown}, which pipeclock does not apply: it knows "
            f"{', '.join(STYLES)}"
        )
    layers, used = _resolve(chunks, plan)
    problems = [p for p in (_problem(layer, ep, source) for layer in layers) if p]
    everyone = comms.all_gather_object((sorted(used), problems, bool(layers)), "agreeing on the ep plan")
    for owner, (_, found, _) in enumerate(everyone):
        if found:
            raise ValueError(f"rank {rank}: {found[0]}" + (f" (on rank {owner})" if owner != rank else ""))
    named = {pattern for used, _, _ in everyone for pattern in used}
    missing = [pattern for pattern in plan if pattern not in named]
    if missing:
        raise ValueError(
            f"rank {rank}: {source} names {', '.join(missing)}, which the model does not have "
            "(no module or weight of any stage matches)"
        )
    if not any(has for _, _, has in everyone):
        raise ValueError(f"rank {rank}: {source} names no experts container ({DISPATCH}) of the model")
    return layers


class ExpertParallel:
    """What ``expert_parallel`` did on this rank: its expert mesh and each chunk's split weights."""

    def __init__(self, mesh: DeviceMesh, per_chunk: list[list[nn.Parameter]]):
        self.mesh = mesh
        self.per_chunk = per_chunk

    @property
    def parameters(self) -> set[nn.Parameter]:
        return {p for chunk in self.per_chunk for p in chunk}

    def sum_gradients(self, chunk: int) -> None:
        """The chunk's expert gradients complete: summed over the ranks holding the same experts (``edp``);
        a block no token reached has a zero gradient, as on one process."""
        edp = self.mesh["edp"]
        for parameter in self.per_chunk[chunk]:
            if parameter.grad is None:
                parameter.grad = DTensor.from_local(
                    torch.zeros_like(parameter.to_local()), self.mesh, parameter.placements, run_check=False,
                    shape=parameter.shape, stride=parameter.stride(),
                )  # fmt: skip
            if edp.size() > 1:
                what = "summing the experts' gradients over the replicas holding them"
                comms.all_reduce(parameter.grad.to_local(), what, edp.get_group())


def expert_parallel(
    chunks: Sequence[nn.Module],
    mesh: DeviceMesh,
    plan: Mapping[str, str],
    ep: int,
    source: str = "the ep plan",
) -> ExpertParallel:
    """Divide the experts of this rank's ``chunks`` over the ep ranks of its stage, in place; every rank
    calls it, together, before ``data_parallel`` (which must leave ``.parameters`` out)."""
    layers = check_plan(chunks, plan, ep, source)
    emesh = expert_mesh(mesh, ep)
    index = emesh.get_local_rank("ep")
    per_chunk: list[list[nn.Parameter]] = [[] for _ in chunks]
    for layer in layers:
        local = layer.module.num_experts // ep
        for weight in layer.weights:
            whole = getattr(layer.module, weight)
            mine = whole.detach()[index * local : (index + 1) * local].clone()
            shard = DTensor.from_local(
                mine,
                emesh,
                [Replicate(), Shard(0)],
                run_check=False,
                shape=whole.shape,
                stride=whole.stride(),
            )
            parameter = nn.Parameter(shard, requires_grad=whole.requires_grad)
            setattr(layer.module, weight, parameter)
            per_chunk[layer.chunk].append(parameter)
        layer.module.num_experts = local
        layer.module.ep_group, layer.module.ep_size = emesh["ep"].get_group(), ep
        layer.module.__class__ = _dispatching(type(layer.module))
    return ExpertParallel(emesh, per_chunk)


_DISPATCHING: dict[type, type] = {}


def _dispatching(family: type) -> type:
    """The family's experts class whose forward is the dispatch, under the same name.

    A subclass rather than a forward set on the instance: that would be a reference cycle (module to
    its forward to module), which keeps the run's process groups alive until the garbage collector
    runs, and a next run in the same process would meet them.
    """
    if family not in _DISPATCHING:

        def forward(self, hidden, top_k_index, top_k_weights):
            with _local_parameters(self):
                own = super(kind, self).forward
                return dispatched(self, own, hidden, top_k_index, top_k_weights, self.ep_group, self.ep_size)

        kind = type(family.__name__, (family,), {"forward": forward, "__module__": family.__module__})
        kind.__qualname__ = family.__qualname__
        _DISPATCHING[family] = kind
    return _DISPATCHING[family]


@contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """While inside, the module's DTensor parameters read as their local blocks (differentiably): the
    family's experts forward indexes them as plain tensors."""
    saved = dict(module._parameters)
    try:
        for name, parameter in saved.items():
            if isinstance(parameter, DTensor):
                module._parameters[name] = parameter.to_local()
        yield
    finally:
        module._parameters.update(saved)


class WithExperts:
    """A dp engine (``data_parallel``'s) whose chunks also hold expert blocks: after a chunk's last
    backward the engine sums the rest over dp, then the experts are summed over ``edp``."""

    def __init__(self, replicas, experts: ExpertParallel):
        self._replicas = replicas
        self.experts = experts

    def __getattr__(self, name: str):
        return getattr(self._replicas, name)

    def after_last_backward(self, chunk: int) -> None:
        self._replicas.after_last_backward(chunk)
        self.experts.sum_gradients(chunk)
