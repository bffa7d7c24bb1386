"""The 2D mesh: dp replicas of a pipeline of pp stages, on torch's ``DeviceMesh``.

Global rank ``r`` sits at row ``r // pp`` (its replica) and column ``r % pp`` (its stage): a pipeline's
ranks are neighbours, which on a multi-GPU machine keeps the busy activation traffic inside one
node while the once-a-step gradient sum crosses nodes. The ``"pp"`` dim's groups carry the pipeline's
messages; the ``"dp"`` dim's groups sum gradients across replicas.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeclock import comm_channels, comms


def init_mesh(dp: int = 1) -> DeviceMesh:
    """The ``("dp", "pp")`` mesh over the whole world (after ``comms.init``); every rank calls it."""
    rank, world = comms.get_rank(), comms.get_world_size()
    if not isinstance(dp, int) or dp < 1 or world % dp:
        raise ValueError(
            f"rank {rank}: --dp {dp} must divide the {world} process(es) into equal pipelines "
            f"(dp x pp = {world})"
        )
    pp = world // dp
    mesh = init_device_mesh(comms.device().type, (dp, pp), mesh_dim_names=("dp", "pp"))
    comm_channels.add_channels([[d * pp + s for s in range(pp)] for d in range(dp)])
    return mesh


def pp_rank(mesh: DeviceMesh) -> int:
    """This rank's stage: its place in its pipeline."""
    return mesh.get_local_rank("pp")


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's replica: which pipeline it belongs to."""
    return mesh.get_local_rank("dp")


def shard_of(batch_size: int, dp: int, replica: int) -> range:
    """The samples of the global batch that replica ``replica`` takes: contiguous, sizes differ by <= 1.

    Any split is exact (each replica's loss is weighted by its share of the global batch); even shards
    only keep the replicas equally busy.
    """
    base, extra = divmod(batch_size, dp)
    start = replica * base + min(replica, extra)
    return range(start, start + base + (replica < extra))
