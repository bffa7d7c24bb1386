"""Will this rank's part of the model fit? The planner's estimate, checked before anything is allocated.

A model too large for the machine is otherwise found out by the kernel's out-of-memory killer, which
ends a process without a word (or by a CUDA out-of-memory error deep inside a forward). So before
building, each rank counts the parameters it will hold (from the model's shapes and the cut), and the
planner (``pipeclock.plan.planner``) turns them into bytes: weights, gradients and Adam's state.
For the MLP, whose layers the planner can describe without measuring them, it adds the activations and
messages the schedule keeps in flight; for a language model the estimate is the parameters' part and
the step's batch of token ids, a floor (a Hugging Face family the planner does not read on paper is
counted on the meta device: ``meta_pieces``). With
``--tp N`` a rank holds one tp rank's share of its stage, as the planner splits a layer
(``pipeclock.plan.tensor_parallel``): 1/N of the parameters and of what a layer keeps inside it. With
``--ep N`` a rank holds 1/N of each of its MoE layers' routed experts, which FSDP2 does not shard. The
run stops only when the estimate exceeds all the memory the rank could have, so an estimate a little
off, or a machine busy for a while, never refuses a run that could fit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import psutil
import torch

from pipeclock import comms
from pipeclock.engine.actions import Schedule
from pipeclock.models.gpt import GPTConfig
from pipeclock.models.partition import partition
from pipeclock.observe.sizes import format_bytes
from pipeclock.plan import experts as expert_plan
from pipeclock.plan import meta_pieces
from pipeclock.plan.hf_paper import paper_model, read_config
from pipeclock.plan.model_layers import rough_layers
from pipeclock.plan.rank_memory import Recompute, Training, rank_memory
from pipeclock.plan.tensor_parallel import MLP, rank_share, split_layers

STATIC = "weights, gradients and Adam state"
IN_FLIGHT = "activations and messages"
BATCH = "the step's token ids"
VOCAB = GPTConfig.vocab_size  # the GPT reads bytes


class ModelTooLargeError(ValueError):
    """The planner's estimate for a rank is more than the memory that rank has."""


def estimate(config, table: Schedule, pipeline_rank: int) -> dict[str, int]:
    """The planner's bytes for ``pipeline_rank``'s part of the model under ``table``, by kind."""
    if len(piece_parameters(config)) < table.placement.num_virtual:
        return {}  # no cut exists: building the stage says why, in the model's own words
    training = Training(config.dtype, "adam", Recompute.parse(config.recompute))
    parameters = rank_parameters(config, table, pipeline_rank, config.tp)
    experts = rank_experts(config, table, pipeline_rank)  # FSDP2 leaves them out of its shards
    shared_by = config.dp if config.data_parallel == "fsdp" else 1  # FSDP2 shards them over the replicas
    per_parameter = training.bytes_per_parameter
    parts = {STATIC: math.ceil((parameters - experts) * per_parameter / shared_by + experts * per_parameter)}
    if config.model == "mlp":
        parts[IN_FLIGHT] = _mlp_in_flight(config, table, pipeline_rank, training)
    else:
        parts[BATCH] = batch_bytes(config)
    return parts


def batch_bytes(config) -> int:
    """A language model's step batch as every rank holds it: this replica's rows of token ids, inputs and
    targets, in int64 (a floor on what a step keeps: its activations come on top)."""
    rows = math.ceil(config.batch_size / config.dp)
    return rows * config.seq_len * 2 * torch.tensor([], dtype=torch.int64).element_size()


def rank_parameters(config, table: Schedule, pipeline_rank: int, tp: int = 1) -> int:
    """The parameters ``pipeline_rank`` will hold: its pieces of the model, cut by layer count; with
    ``tp`` > 1, one tp rank's share of each piece (``tensor_parallel.rank_share``: a floor).

    Counted from the models' shapes, not by building them: even on the meta device, building a large
    model costs seconds of PyTorch's own imports at every start.
    """
    pieces = [rank_share(count, tp) for count in piece_parameters(config)]
    held = _held(config, table, pipeline_rank)
    total = sum(pieces[i] for i in held)
    if held[0] == 0 and held[-1] == len(pieces) - 1:
        total -= rank_share(_tied_matrix(config), tp)  # the embedding and the head share one matrix here
    if config.ep > 1:  # of each MoE layer's routed experts, 1/ep
        routed = expert_plan.routed_parameters(hf_model(config))
        total -= sum(routed - routed // config.ep for i in held if 0 < i < len(pieces) - 1)
    return total


def rank_experts(config, table: Schedule, pipeline_rank: int) -> int:
    """The routed experts' parameters ``pipeline_rank`` holds under ``--ep``: 1/ep of each of its MoE
    layers' (whole over its dp replicas: FSDP2 leaves them out); 0 without ep."""
    if config.ep == 1:
        return 0
    layers = len(piece_parameters(config)) - 2
    held = [i for i in _held(config, table, pipeline_rank) if 0 < i <= layers]
    return len(held) * (expert_plan.routed_parameters(hf_model(config)) // config.ep)


def _held(config, table: Schedule, pipeline_rank: int) -> list[int]:
    """The pieces ``pipeline_rank`` holds, in order: the model cut by layer count over the stages."""
    cut = partition(len(piece_parameters(config)), table.placement.num_virtual)
    return sorted(i for stage in table.placement.stages[pipeline_rank] for i in cut[stage])


def _tied_matrix(config) -> int:
    """The parameters of the matrix the embedding and the head share (0 when they share none)."""
    if config.model == "gpt":
        return VOCAB * config.dim
    if config.model != "hf":
        return 0
    try:
        model = hf_model(config)
    except (ValueError, AttributeError):
        return _counted_on_meta(config)[1]
    return model.vocab * model.hidden if model.tied else 0


def _counted_on_meta(config) -> tuple[list[int], int]:
    """(pieces, tied matrix) of a family the paper model does not read, from its model on the meta device;
    none under ``--ep`` (experts counted whole would refuse runs that fit) or when it cannot be built
    (building the stage says why)."""
    if config.ep > 1:
        return [], 0
    try:
        pieces, tied = meta_pieces.counted(str(config.hf_config or config.hf_model), config.trust_remote_code)
    except (ValueError, AttributeError, OSError):
        return [], 0
    return list(pieces), tied


def hf_model(config):
    """A Hugging Face model's sizes on paper (``--hf-config`` or ``--hf-model``'s config.json)."""
    return paper_model(read_config(config.hf_config or config.hf_model))


def piece_parameters(config) -> list[int]:
    """Parameters of each piece: the MLP's Linear layers, the GPT's or a Hugging Face model's embedding,
    blocks (every expert of a mixture, whole) and head."""
    if config.model == "mlp":
        return [config.hidden**2 + config.hidden] * config.layers
    if config.model == "hf":
        try:
            model = hf_model(config)
        except (ValueError, AttributeError):  # a family not read on paper: counted on the meta device
            return _counted_on_meta(config)[0]
        return [model.embedding_parameters(), *[model.layer_parameters()] * model.layers,
                model.head_parameters()]  # fmt: skip
    dim, vocab = config.dim, VOCAB
    block = 12 * dim**2 + 13 * dim  # two norms, qkv, the projection, the MLP's two Linears
    return [vocab * dim, *[block] * config.layers, vocab * dim + 2 * dim]


def _mlp_in_flight(config, table: Schedule, pipeline_rank: int, training: Training) -> int:
    samples = math.ceil(config.batch_size / config.dp / config.microbatches)
    whole = rough_layers(config.layers * config.hidden**2, config.layers, samples)
    layers = split_layers(whole, config.tp, MLP)  # one tp rank's share, as the planner splits a layer
    cut = partition(config.layers, table.placement.num_virtual)
    memory = rank_memory(layers, cut, table, training)[pipeline_rank]
    return memory.activations + memory.messages + memory.workspace


def available(device: torch.device) -> tuple[int, str]:
    """The most bytes this rank can have, and where that figure comes from.

    The whole memory, not what is free now: a busy machine frees memory as other jobs end, so only a
    run that could never fit is refused. On a GPU, the device's memory; on the CPU, the machine's (or
    its cgroup's limit), shared by the ranks torchrun started on it.
    """
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return total, f"the memory of {device}"
    machine = psutil.virtual_memory().total
    limit = _cgroup_limit()
    if limit is not None:
        machine = min(machine, limit)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return machine // local, f"this machine's {format_bytes(machine)} shared by {local} rank(s)"


def _cgroup_limit() -> int | None:
    """The cgroup v2 memory limit (a container's), or None without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return None
    return int(limit) if limit.isdigit() else None


def check_fits(config, table: Schedule, pipeline_rank: int, device: torch.device) -> None:
    """``ModelTooLargeError`` on every rank when the estimate does not fit on one of them.

    Each rank judges its own part against its own memory (nodes may differ), then all share the
    verdicts, so no rank goes on to wait for a peer that stopped.
    """
    mine = _verdict(estimate(config, table, pipeline_rank), *available(device))
    verdicts = comms.all_gather_object(mine, "agreeing that the model fits")
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            raise ModelTooLargeError(
                f"rank {comms.get_rank()}: the model does not fit on rank {rank}: {verdict}"
            )


def _verdict(parts: dict[str, int], room: int, where: str) -> str | None:
    total = sum(parts.values())
    if total <= room:
        return None
    detail = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts.items())
    floor = "" if IN_FLIGHT in parts else "at least "
    cure = (
        "a smaller --batch-size"
        if parts.get(BATCH, 0) * 2 > total
        else "more stages (processes), a smaller model, or --dp with fsdp (`python -m pipeclock plan` "
        "compares layouts)"
    )
    return (
        f"the planner estimates {floor}{format_bytes(total)} ({total:,} bytes) for its part ({detail}), "
        f"but it has {format_bytes(room)} ({where}); use {cure}"
    )
