"""Data x pipeline parallel: dp replicas of a p-stage pipeline give one process's gradients.

The global batch is cut into dp contiguous shards (uneven when it does not divide), each replica runs
the whole schedule on its shard, and FSDP2 or DDP sums the replicas' gradients once per step. For every
(dp, pp), schedule, micro-batch count and both engines, the loss and every gradient of a GPT (tied
embedding, padded token targets, dropout) equal the whole model's on one process for the global batch.
"""

from __future__ import annotations

import pytest
import torch

from pipeclock import parallel, schedule
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.models.gpt import GPT, GPTConfig
from tests.distributed import run_ok
from tests.test_gpt_pipeline import PLACEMENT, SCHEDULE_CHUNKS, padded_batch, worst_gap

TOLERANCE = 1e-5


def config(dropout: float) -> GPTConfig:
    """Two blocks: with the embedding and the head, enough pieces for 2 stages on a V (4 chunks)."""
    return GPTConfig(dim=16, layers=2, heads=2, seq_len=8, dropout=dropout, seed=11)


def full_gradient(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter's whole gradient: FSDP2's shards gathered (a collective over the replicas)."""
    grad = parameter.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def one_case(mesh, engine: str, name: str, m: int, batch: int, dropout: float) -> float:
    """Worst relative gap (loss and gradients) between this (dp, pp) pipeline and one process."""
    dp, pp = mesh["dp"].size(), mesh["pp"].size()
    cfg, loss_fn = config(dropout), TokenCrossEntropy()
    chunks = GPT.for_rank(cfg, parallel.pp_rank(mesh), pp, SCHEDULE_CHUNKS[name], PLACEMENT.get(name))
    replicas = parallel.data_parallel(chunks, mesh, engine)
    pipe = schedule.Pipeline(replicas.chunks, name, m, loss_fn, group=mesh.get_group("pp"), replicas=replicas)
    ids, targets = padded_batch(batch, seed=batch * 7 + m)
    mine = parallel.shard_of(batch, dp, parallel.dp_rank(mesh))
    loss = pipe.step(ids[mine.start : mine.stop], targets[mine.start : mine.stop])
    return worst_gap(cfg, ids, targets, loss, replicas.modules, full_gradient)


def mesh_cases(rank: int, world: int) -> dict[tuple, float]:
    """Every case for the meshes of ``world`` ranks with dp in {world, world // 2}."""
    results = {}
    for dp in (world, world // 2):
        mesh = parallel.init_mesh(dp)
        for engine in parallel.DATA_PARALLEL:
            for name in SCHEDULE_CHUNKS:
                for m in (1, 3):
                    for batch in (2 * dp * m, 2 * dp * m + 1):  # even and uneven shards
                        dropout = 0.2 if batch % 2 else 0.0
                        key = (dp, world // dp, engine, name, m, batch)
                        results[key] = one_case(mesh, engine, name, m, batch, dropout)
    return results


def check_meshes(world: int) -> None:
    per_rank = run_ok(mesh_cases, world, deadline=600)
    cases = per_rank[0].keys()
    assert len(cases) == 2 * 2 * len(SCHEDULE_CHUNKS) * 2 * 2
    worst = {case: max(results[case] for results in per_rank) for case in cases}
    bad = {case: gap for case, gap in worst.items() if gap > TOLERANCE}
    assert not bad, f"(dp, pp) pipelines differ from one process in {len(bad)} cases: {bad}"


def test_dp2_pp1_and_dp1_pp2_give_the_one_process_gradients_for_every_schedule_and_engine():
    check_meshes(2)


@pytest.mark.long  # 40-60 s on 2 cores; the dp 2 and pp 2 meshes above run by default
def test_dp4_pp1_and_dp2_pp2_give_the_one_process_gradients_for_every_schedule_and_engine():
    check_meshes(4)
