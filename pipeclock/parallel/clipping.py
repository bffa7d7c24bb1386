"""Global gradient clipping: one norm over the whole model, whatever the (dp, pp, tp) cut.

On one process ``clip_grad_norm_`` takes the norm over every parameter. Pipelined, each rank holds
some stages' parameters; with FSDP2 each holds a shard of them; with tensor parallel a split layer's
shard, and whole copies of the layers left unsplit; a tied weight has a copy on two ranks. The norm's
square is a sum of squares, so every rank adds the squares of what it alone accounts for (its shards; a
gradient that several ranks hold alike, on the first of them along each mesh dim that replicates it; a
tie's copy once) and one all-reduce adds the ranks' parts. Every rank then scales its gradients by the
same factor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pipeclock import comms
from pipeclock.engine.orchestrator import Pipeline
from pipeclock.engine.ties import tie_key


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _counted_gradients(pipe: Pipeline, mesh: DeviceMesh | None) -> list[torch.Tensor]:
    """This rank's gradients, a tied weight's once: on the lowest rank holding it, its first copy there;
    with a mesh, a gradient held alike by several ranks only on the first of them (``_counted_here``)."""
    rank = comms.get_rank()
    counting_rank = {tied.key: tied.ranks[0] for tied in pipe.ties.ties or []}
    counted_ties: set[str] = set()
    grads = []
    for param in _distinct_parameters(pipe):
        key = tie_key(param)
        if param.grad is None:
            continue
        if key is not None:
            if counting_rank.get(key, rank) != rank or key in counted_ties:
                continue
            counted_ties.add(key)
        if mesh is None or _counted_here(param.grad, mesh):
            grads.append(_local(param.grad))
    return grads


def _counted_here(grad: torch.Tensor, mesh: DeviceMesh) -> bool:
    """Whether this rank counts ``grad``: it is first along every mesh dim over which ``grad`` is the
    same on every rank (a whole gradient: dp without FSDP2, and tp; a DTensor: its ``Replicate`` dims
    and the dims it does not span; any other placement, FSDP2's strided shards included, splits it)."""
    split: set[str] = set()
    if isinstance(grad, DTensor) and "ep" in (grad.device_mesh.mesh_dim_names or ()):
        # an expert block (``parallel.experts``): on the first of the dp ranks holding that block
        return grad.device_mesh.get_local_rank("edp") == 0 and mesh.get_local_rank("tp") == 0
    if isinstance(grad, DTensor):
        names = grad.device_mesh.mesh_dim_names or ()
        split = {name for name, place in zip(names, grad.placements, strict=True) if not place.is_replicate()}
    return all(mesh.get_local_rank(dim) == 0 for dim in ("dp", "tp") if dim not in split)


def _distinct_parameters(pipe: Pipeline) -> list[torch.nn.Parameter]:
    found: dict[int, torch.nn.Parameter] = {}
    for chunk in pipe.chunks:
        for param in chunk.parameters():
            found.setdefault(id(param), param)
    return list(found.values())


def grad_norm(pipe: Pipeline, mesh: DeviceMesh | None = None) -> float:
    """The 2-norm of the whole model's gradient, on every rank (after ``pipe.step``).

    ``mesh`` is the run's (dp, pp, tp) mesh (``init_mesh``): needed when tensor parallel splits layers,
    whose unsplit layers every tp rank holds alike. Without it each replica's pipeline is summed alone.
    """
    grads = _counted_gradients(pipe, mesh)
    squares = torch.zeros((), dtype=torch.float64, device=pipe.device)
    for grad in grads:  # accumulated in float64 without a float64 copy of the gradient: 1.6x faster
        squares += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
    # Counted once across the mesh, or sharded (every rank's squares its own): summed over the world.
    # Replicated without a mesh: one replica's pipeline suffices.
    group = None if mesh is not None or pipe.replicas.shards_gradients else pipe.group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        comms.all_reduce(squares, "adding up the gradient norm", group)
    return float(squares.sqrt())


def clip_grad_norm(pipe: Pipeline, max_norm: float, mesh: DeviceMesh | None = None) -> float:
    """Scale every gradient so that the whole model's norm is at most ``max_norm``; returns the norm.

    The same factor as ``torch.nn.utils.clip_grad_norm_`` on one process: ``max_norm / (norm + 1e-6)``,
    applied only when below 1. ``mesh``: as for ``grad_norm``.
    """
    norm = grad_norm(pipe, mesh)
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        with torch.no_grad():
            for param in _distinct_parameters(pipe):
                if param.grad is not None:
                    _local(param.grad).mul_(factor)
    return norm
