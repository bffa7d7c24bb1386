"""What torch's pipelining of December 2024 held on torchtitan's 405B pipeline rows (Tables 5 and 6), rank by
rank, beside the planner's count: a reading, not yet part of the planner.

    python -m benchmarks.stage_buffers

Two things the planner's count (everything at its most at once) leaves out:

- **the stages' buffers**: a ``PipelineStage`` kept every micro-batch's output in ``output_chunks`` until
  the next step (torch/distributed/pipelining/stage.py before pytorch/pytorch#153383, 2025-05-13, which
  keeps only the last stage's), the last stage's logits too (kept to be returned; #138504, 2024-10-21,
  detaches them, and #159251 of 2025-07 asks to stop keeping them), and allocated one activation receive
  buffer (stages after the first) and one gradient receive buffer (stages before the last) per
  micro-batch, once (``_prepare_forward_infra``, ``_prepare_backward_infra``). The planner counts one
  buffer of each;
- **when the gradients appear**: torchtitan zeroes them (``optimizers.zero_grad()``, to None) before each
  step, and FSDP2 with gradient sync off (torch's pipelining turns it off until a stage's last backward)
  allocates a stage's unsharded fp32 gradients at its first backward (``to_accumulated_grad_if_needed``
  in ``_fsdp_param.py``). A rank holding two stages (interleaved 1F1B) holds the second's only from its
  first backward on, after the activations have begun to go.

`peaks` walks each rank's own order of actions (the planner's schedule table) and takes the most it holds
after each: the activations of the micro-batches in flight (the planner's bytes a layer), the gradients
of the stages whose backward has begun, and with ``buffers`` the outputs so far, the receive buffers
and no longer the planner's two; the rest of the planner's count (weights, optimizer, working memory,
allowance) is kept as it is.
"""

from __future__ import annotations

from pipeclock.engine.actions import placement_of
from pipeclock.plan import activations, calibration, context_parallel
from pipeclock.plan.cluster_memory import (
    _rank_memory,
    held_microbatches,
    layer_parameters_per_gpu,
    placement_for,
    stage_layers,
)
from pipeclock.plan.pipeline_replay import schedule_table
from pipeclock.plan.search import search

GIB = 2**30
SOURCES = ("torchtitan T5", "torchtitan T6")


def _layer_bytes(model, config, job, software) -> float:
    """What one layer keeps for one micro-batch on one rank, as the planner counts it."""
    gathered = (
        (1 if software.dtype == "fp8" else software.activation_bytes) if software.tp_gathered_inputs else 0
    )
    kept = activations.layer_bytes(
        model, config.recompute, software.activation_bytes, software.fused, config.tp,
        config.sequence_parallel, software.saved_input_bytes, gathered,
    )  # fmt: skip
    return kept * context_parallel.local_tokens(config, job)


def _stage_gradients(model, config, cuts, stage: int) -> float:
    """A stage's fp32 gradients on one rank, bytes (its blocks, the embedding or the head it carries)."""
    parameters = len(cuts[stage]) * layer_parameters_per_gpu(model, config.tp)
    parameters += model.embedding_parameters() / config.tp if stage == 0 else 0.0
    parameters += model.head_parameters() / config.tp if stage == config.pp * config.chunks - 1 else 0.0
    return 4.0 * parameters


def peaks(model, config, job, software, buffers: bool) -> list[float]:
    """Each rank's most, GiB with the allowance (the module's walk)."""
    cuts = stage_layers(model, config)
    held = held_microbatches(config.schedule, config.pp, config.microbatches, config.chunks)
    placement = placement_for(config.schedule, config.pp, config.chunks)
    table = schedule_table(config.schedule, config.pp, config.microbatches, config.chunks)
    order = placement_of(table)
    m, a, last = config.microbatches, software.activation_bytes, config.pp * config.chunks - 1
    tokens = context_parallel.local_tokens(config, job)
    message = tokens * model.hidden * a / (config.tp if config.sequence_parallel else 1)
    logits = tokens * model.vocab / config.tp * a
    layer = _layer_bytes(model, config, job, software)
    result = []
    for rank, actions in enumerate(table):
        stages = placement.stages[rank]
        planner = _rank_memory(model, config, job, software, cuts, rank, held[rank], placement)
        most_layers = max(len(cuts[s]) for s in stages)
        counted = held[rank][0] * most_layers * layer + planner.gradients  # what the walk replaces
        live, done, started, most = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0), set(), 0.0
        for action in actions:
            stage = order.stage(rank, action.chunk)
            if action.op == "F":
                live[stage] += 1
                done[stage] += 1
            elif action.op == "B":
                started.add(stage)
            now = sum(live[s] * len(cuts[s]) * layer for s in stages)
            now += sum(_stage_gradients(model, config, cuts, s) for s in started)
            if buffers:
                now += sum(done[s] * (logits if s == last else message) for s in stages)
                now += sum(m * message for s in stages if s != last)
                now += sum((m - live[s]) * message for s in stages if s != 0) - 2 * message
            most = max(most, now)
            if action.op == "B":
                live[stage] -= 1
        allocated = planner.allocated - counted + most
        result.append((allocated * (1 + calibration.ALLOCATOR_SLACK) + calibration.RUNTIME_BYTES) / GIB)
    return result


def report() -> str:
    """The planner's fullest rank on each row, and the walk's, without and with the stages' buffers."""
    from benchmarks.published_2024 import titan_rows

    lines = [
        "| row | published GiB | planner | walked | walked, with the stages' buffers (rank) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in titan_rows():
        if row.source not in SOURCES:
            continue
        best = search(row.model, row.cluster, row.job, row.software, row.fixed, top=1).ranked[0]
        config, planner = best.config, best.memory.total / GIB
        walked = max(peaks(row.model, config, row.job, row.software, False))
        both = peaks(row.model, config, row.job, row.software, True)
        top = max(range(len(both)), key=both.__getitem__)
        lines.append(
            f"| {row.source} {row.name} | {row.memory:g} | {planner:.1f} ({planner / row.memory - 1:+.1%}) "
            f"| {walked:.1f} ({walked / row.memory - 1:+.1%}) "
            f"| {both[top]:.1f} ({both[top] / row.memory - 1:+.1%}, rank {top}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
