"""A rank's share of the run, one function per axis in a fixed order: its stage built, split over its tp
group (torch's tensor parallel, the model's plan), made a replica over its dp group (FSDP2 or DDP), and
run by a pipeline over its pp group, all on one (dp, pp, tp) mesh.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipeclock import comms
from pipeclock.engine.orchestrator import Pipeline
from pipeclock.parallel import data_parallel, dp_rank, init_mesh, pp_rank, shard_of
from pipeclock.parallel.experts import WithExperts, expert_parallel
from pipeclock.parallel.tensor_parallel import tensor_parallel
from pipeclock.training.balance import stage_cut
from pipeclock.training.compiled import compile_blocks
from pipeclock.training.task_choice import make_task


def build_stage(config, rank: int, world: int, task=None, cut=None) -> list[torch.nn.Module]:
    """This rank's chunks of the model, on its device; nothing of the other ranks' layers is allocated.

    Which virtual stages they are is the schedule's placement (the loop, a V, or a file's); ``cut``: the
    one ``stage_cut`` chose (every rank calls it, once), by default chosen here.
    """
    task = task or make_task(config)
    placement = config.table(world).placement
    cut = cut if cut is not None else stage_cut(config, config.table(world))
    return [part.to(comms.device()) for part in task.build(rank, world, placement, cut)]


def build_pipeline(config, task) -> tuple[Pipeline, list[nn.Module], slice, DeviceMesh | None]:
    """This rank's pipeline, the modules it holds (as built), its replica's slice of each batch, and the
    mesh (None for one plain pipeline).

    With ``dp`` or ``tp`` > 1 the world is a (dp, pp, tp) mesh, and one function per axis applies in a
    fixed order: the stage is built, split over its "tp" group (torch's tensor parallel, the model's
    plan), made a replica over the "dp" group (FSDP2 or DDP), and run by the pipeline on its "pp" group.
    """
    world = comms.get_world_size()
    options = dict(measure_memory=config.measure_memory, recompute=config.recompute, dtype=config.dtype)
    if config.dp == config.tp == 1:
        modules = build_stage(config, comms.get_rank(), world, task)
        if config.compile:
            compile_blocks(modules)
        pipe = Pipeline(modules, config.table(world), config.microbatches, task.loss_fn, **options)
        return pipe, modules, slice(None), None
    mesh = init_mesh(config.dp, config.tp)
    pp, table = mesh["pp"].size(), config.table(mesh["pp"].size())
    cut = stage_cut(config, table)
    modules = build_stage(config, pp_rank(mesh), pp, task, cut)
    if config.tp > 1:
        plan = task.tp_plan(config.tp, cut, table.placement.num_virtual)
        tensor_parallel(modules, mesh, plan, f"--tp-plan {config.tp_plan}" if config.tp_plan else "the plan")
    experts = None
    if config.ep > 1:  # before compiling: the experts' forward becomes the all-to-all dispatch
        experts = expert_parallel(modules, mesh, task.ep_plan(config.ep), config.ep, _ep_source(config))
    if config.compile:
        compile_blocks(modules)
    chunks = modules
    if config.dp > 1:
        ignored = experts.parameters if experts else None
        replicas = data_parallel(modules, mesh, config.data_parallel, ignored)
        chunks, modules = replicas.chunks, replicas.modules
        options |= dict(replicas=WithExperts(replicas, experts) if experts else replicas)
    groups = dict(group=mesh.get_group("pp"), tp_group=mesh.get_group("tp"))
    pipe = Pipeline(chunks, table, config.microbatches, task.loss_fn, **groups, **options)
    shard = shard_of(config.batch_size, config.dp, dp_rank(mesh))
    return pipe, modules, slice(shard.start, shard.stop), mesh


def _ep_source(config) -> str:
    return f"--ep-plan {config.ep_plan}" if config.ep_plan else "the model's ep plan"
