"""The 3D mesh: dp replicas of a pipeline of pp stages, each stage shared by tp ranks (torch's DeviceMesh).

Global rank ``r`` sits at ``(dp, pp, tp) = (r // (pp * tp), (r // tp) % pp, r % tp)``: tensor parallel is
innermost, so the tp ranks of one stage are neighbours (the GPUs of one node, where the per-layer
all-reduces need the fastest links), a pipeline's stages come next (one activation message per
micro-batch), and the replicas are furthest apart (one gradient sum per step). Every process group comes
from this one mesh: ``"tp"`` carries tensor parallel's collectives, ``"pp"`` the pipeline's messages (tp
rank t of stage s exchanges with tp rank t of stage s +- 1), ``"dp"`` the gradient sums across replicas.

The groups are created here with the run's timeout (``comms.timeout``), so a collective inside a
tensor-parallel layer whose peer died fails within it, like every other blocking call.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipeclock import comm_channels, comms

DIMS = ("dp", "pp", "tp")


def init_mesh(dp: int = 1, tp: int = 1) -> DeviceMesh:
    """The ``("dp", "pp", "tp")`` mesh over the whole world (after ``comms.init``); every rank calls it.

    ``pp`` is what is left: ``world // (dp * tp)``.
    """
    rank, world = comms.get_rank(), comms.get_world_size()
    for flag, value in (("--dp", dp), ("--tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"rank {rank}: {flag} must be a whole number >= 1, got {value!r}")
    if world % (dp * tp):
        raise ValueError(
            f"rank {rank}: --dp {dp} x --tp {tp} = {dp * tp} does not divide the {world} process(es) "
            f"into equal pipelines (processes = dp x pp x tp)"
        )
    layout = mesh_layout(world, dp, tp)
    groups = [_groups_along(layout, dim) for dim in range(len(DIMS))]
    mesh = DeviceMesh.from_group(groups, comms.device().type, layout, mesh_dim_names=DIMS)
    comm_channels.add_channels(pipelines(world, dp, tp))
    return mesh


def mesh_layout(world: int, dp: int = 1, tp: int = 1) -> torch.Tensor:
    """The global ranks as a ``(dp, pp, tp)`` array: ``layout[d, s, t]`` is replica d's stage s, tp rank t."""
    return torch.arange(world, dtype=torch.int).reshape(dp, world // (dp * tp), tp)


def pipelines(world: int, dp: int = 1, tp: int = 1) -> list[list[int]]:
    """Every pipeline's global ranks, stage by stage: one per (replica, tp rank)."""
    layout = mesh_layout(world, dp, tp)
    return [layout[d, :, t].tolist() for d in range(dp) for t in range(tp)]


def _groups_along(layout: torch.Tensor, dim: int) -> dist.ProcessGroup:
    """This rank's group along mesh dim ``dim``; every rank creates every group (``new_group`` is
    collective), each with the run's timeout."""
    rank, timeout = comms.get_rank(), datetime.timedelta(seconds=comms.timeout())
    mine = None
    for ranks in layout.movedim(dim, -1).reshape(-1, layout.shape[dim]).tolist():
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def pp_rank(mesh: DeviceMesh) -> int:
    """This rank's stage: its place in its pipeline."""
    return mesh.get_local_rank("pp")


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's replica: which pipeline it belongs to."""
    return mesh.get_local_rank("dp")


def tp_rank(mesh: DeviceMesh) -> int:
    """This rank's place among the ranks that share its stage."""
    return mesh.get_local_rank("tp")


def shard_of(batch_size: int, dp: int, replica: int) -> range:
    """The samples of the global batch that replica ``replica`` takes: contiguous, sizes differ by <= 1.

    Any split is exact (each replica's loss is weighted by its share of the global batch); even shards
    only keep the replicas equally busy. The tp ranks of a stage all take their replica's shard.
    """
    base, extra = divmod(batch_size, dp)
    start = replica * base + min(replica, extra)
    return range(start, start + base + (replica < extra))
