"""Beyond one pipeline: the (dp, pp) mesh, data-parallel replicas of a pipeline, global gradient clipping.

rank, world = comms.init()
mesh = parallel.init_mesh(dp=2)                       # world = dp x pp, dims ("dp", "pp")
stage = model.ShardedMLP(..., stage=parallel.pp_rank(mesh), num_stages=mesh["pp"].size())
replicas = parallel.data_parallel([stage], mesh, "fsdp")   # or "ddp"
pipe = schedule.Pipeline(replicas.chunks, "1f1b", 8, loss_fn,
                         group=mesh.get_group("pp"), replicas=replicas)
loss = pipe.step(my_inputs, my_targets)               # this replica's shard of the global batch
parallel.clip_grad_norm(pipe, 1.0)

May import: comms, engine, models.
"""

from pipeclock.parallel.clipping import clip_grad_norm, grad_norm
from pipeclock.parallel.mesh import dp_rank, init_mesh, pp_rank, shard_of
from pipeclock.parallel.replicas import DATA_PARALLEL, data_parallel

__all__ = [
    "DATA_PARALLEL",
    "clip_grad_norm",
    "data_parallel",
    "dp_rank",
    "grad_norm",
    "init_mesh",
    "pp_rank",
    "shard_of",
]
