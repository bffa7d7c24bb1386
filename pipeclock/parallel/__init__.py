"""Beyond one pipeline: the (dp, pp, tp) mesh, tensor parallel inside a stage, data-parallel replicas of a
pipeline, experts over ranks carved from dp, global gradient clipping. One function per axis, applied in
a fixed order: the stage's modules are built, split by tensor parallel, their experts divided (ep), then
made replicas, then run by the pipeline.

rank, world = comms.init()
mesh = parallel.init_mesh(dp=2, tp=2)                 # world = dp x pp x tp, dims ("dp", "pp", "tp")
stage = model.ShardedMLP(..., stage=parallel.pp_rank(mesh), num_stages=mesh["pp"].size())
parallel.tensor_parallel([stage], mesh, plan)         # a plan such as models.gpt.tp_plan(config, 2)
replicas = parallel.data_parallel([stage], mesh, "fsdp")   # or "ddp" (without tensor parallel)
# a mixture of experts: experts = parallel.expert_parallel([stage], mesh, hf.ep_plan(config, 2), 2)
# before data_parallel(..., "fsdp", experts.parameters); replicas=parallel.WithExperts(replicas, experts)
pipe = schedule.Pipeline(replicas.chunks, "1f1b", 8, loss_fn,
                         group=mesh.get_group("pp"), replicas=replicas)
loss = pipe.step(my_inputs, my_targets)               # this replica's shard of the global batch
parallel.clip_grad_norm(pipe, 1.0, mesh)

May import: comms, engine, models.
"""

from pipeclock.parallel.clipping import clip_grad_norm, grad_norm
from pipeclock.parallel.experts import WithExperts, expert_parallel
from pipeclock.parallel.mesh import dp_rank, init_mesh, pp_rank, shard_of, tp_rank
from pipeclock.parallel.replicas import DATA_PARALLEL, data_parallel
from pipeclock.parallel.tensor_parallel import tensor_parallel

__all__ = [
    "DATA_PARALLEL",
    "WithExperts",
    "clip_grad_norm",
    "data_parallel",
    "dp_rank",
    "expert_parallel",
    "grad_norm",
    "init_mesh",
    "pp_rank",
    "shard_of",
    "tensor_parallel",
    "tp_rank",
]
