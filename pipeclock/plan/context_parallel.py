"""Context parallel on paper: each sequence's tokens over ``cp`` ranks that hold the same weights.

Every activation of a layer is split over the sequence, so a rank holds, computes and sends ``1/cp`` of
a micro-batch's tokens (`local_tokens`): its products, its elementwise work, its tensor-parallel
collectives and what it keeps for the backward are those of ``seq / cp`` tokens. Attention alone needs
the others' keys and values. The implementations cut the causal sequence into ``2 x cp`` chunks and give
rank i chunks i and 2 cp - 1 - i, so that every rank computes the same share of the causal square
(Megatron-Core with Transformer Engine; torch's ``context_parallel`` with its load balancing, on by
default; Meta's Llama 3, arXiv 2407.21783v3 section 3.3.2): a rank's attention is ``1/cp`` of the
sequence's, in ``cp`` equal blocks, one per rank's keys and values. What moves, per layer, are those keys
and values (grouped-query attention's, split over tp like the heads), on the node's link while the tp x cp
ranks fit in a node and on each GPU's network share past it (cp is the degree next to tp); a model that
repeats its key and value heads to the query heads before attention (``Software.repeat_kv``) moves them
that wide:

- ``all-gather`` (torch's ``context_parallel``, whose default rotation all-gathers the keys and values
  once, started before the local block's attention, so that block hides it): forward, the all-gather
  less the local block's attention; backward, the all-gather again less the local block's backward, and
  the keys' and values' gradients, in fp32, passed around the ring one block a step, each send hidden
  behind the next block's backward but the last (``torch/distributed/tensor/experimental/_attention.py``);
  and its bookkeeping around each block, through memory: the blocks' outputs merged in fp32, the
  gradients accumulated in fp32 (`merge_seconds`);
- ``ring`` (Megatron-Core's ``cp_comm_type="p2p"``, Transformer Engine's default): each of the cp - 1
  steps sends one block of keys and values to the next rank while the current block computes, and the
  backward sends the gradients' block with it; only what a step's send takes beyond the step's attention
  is exposed, plus the last gradients' send;
- ``all-gather-exposed`` (Meta's Llama 3: "the all-gather communication latency is exposed in the critical
  path"): the forward's all-gather and the backward's reduce-scatter of the gradients, both whole.

The gradients' reduction and ZeRO's sharding run over the dp x cp ranks that hold the same weights
(torchtitan's ``dp_shard_cp`` mesh, Megatron-Core's data-parallel group with cp): `Config.replicas`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeclock.plan import activations, calibration
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.gpus import GpuKind
from pipeclock.plan.paper_model import PaperModel

GRADIENT_BYTES = 4  # torch's ring passes the keys' and values' gradients in fp32 (``convert_to_f32``)
# torch's bookkeeping around each block's attention, in bytes through memory per element of a rank's
# attention output (queries' width) or of its keys and values, counted from ``_attention.py``: forward,
# each block after the first converted to fp32 (2 + 4) and merged, ``out - sigmoid(lse_b - lse) *
# (out - out_b)`` (12 + 8 + 12), 38 an element, or, for the blocks that update only the second half of
# the output (about half of them), 38 a half-size element and a ``torch.cat`` of the whole (8): 27 an
# element; the backward's fp32 accumulation of each block's gradients (``+=``: 10) or its
# ``_partial_update`` (half the elements, then a ``torch.cat``: 13), and the keys' and values' gradients
# concatenated for the next send (8)
MERGE_FORWARD_BYTES = 32.0
MERGE_BACKWARD_BYTES = (12.0, 20.0)  # per element of the queries' gradient, of the keys' (or values')


@dataclass(frozen=True)
class Exchange:
    """One layer's exposed key/value traffic for one micro-batch on one rank, in seconds."""

    forward: float = 0.0
    backward: float = 0.0


def local_tokens(config: Config, job: Job) -> int | float:
    """The tokens of one micro-batch on one rank: ``mbs x seq / cp`` (``mbs x seq`` exactly when cp is 1)."""
    tokens = config.microbatch_size * job.seq_len
    return tokens if config.cp == 1 else tokens / config.cp


def kv_bytes(model: PaperModel, tp: int, a: int, repeated: bool = False) -> float:
    """Bytes of one token's keys and values on one tp rank: grouped-query attention's (at least one head),
    or as wide as the queries when ``repeated``."""
    return 2.0 * (model.q_dim / tp if repeated else activations.kv_width(model, tp)) * a


def link(config: Config, gpu: GpuKind) -> float:
    """The cp ranks' link, bytes/s achieved: the node's while tp x cp ranks fit in one, else the network's."""
    inside = config.tp * config.cp <= gpu.gpus_per_node
    return (gpu.intra_node_bandwidth if inside else gpu.inter_node_bandwidth) * calibration.LINK_EFFICIENCY


def block_bytes(model: PaperModel, config: Config, job: Job, software: Software) -> float:
    """One rank's keys and values for one micro-batch and one layer: what one step of the ring sends."""
    a = software.activation_bytes
    return local_tokens(config, job) * kv_bytes(model, config.tp, a, software.repeat_kv)


def exchange(model: PaperModel, config: Config, job: Job, software: Software, gpu: GpuKind,
             attention: float) -> Exchange:  # fmt: skip
    """One layer's exposed exchange (the module's rules), given its forward attention's ``attention``
    seconds on this rank; the backward's attention is taken as 2.5 times it, as `cluster_time` charges."""
    cp = config.cp
    if cp == 1 or model.kind == "mlp":
        return Exchange()
    a, bandwidth, latency = software.activation_bytes, link(config, gpu), calibration.COLLECTIVE_LATENCY
    block = block_bytes(model, config, job, software)
    gathered = (cp - 1) * block / bandwidth + latency  # an all-gather (or reduce-scatter) of the blocks
    step_forward, step_backward = attention / cp, 2.5 * attention / cp
    if software.cp_exchange == "all-gather-exposed":
        return Exchange(gathered, gathered)
    if software.cp_exchange == "all-gather":
        gradients = block * GRADIENT_BYTES / a / bandwidth + latency
        backward = max(0.0, gathered - step_backward) + (cp - 1) * max(0.0, gradients - step_backward)
        merge_forward, merge_backward = merge_seconds(model, config, job, software, gpu)
        return Exchange(
            max(0.0, gathered - step_forward) + merge_forward, backward + gradients + merge_backward
        )
    send = block / bandwidth + latency  # ring: one block a step, the gradients' block with it backward
    backward = (cp - 1) * max(0.0, 2 * send - step_backward) + send
    return Exchange((cp - 1) * max(0.0, send - step_forward), backward)


def merge_seconds(model: PaperModel, config: Config, job: Job, software: Software,
                  gpu: GpuKind) -> tuple[float, float]:  # fmt: skip
    """torch's bookkeeping around the blocks' attention (`MERGE_FORWARD_BYTES`, `MERGE_BACKWARD_BYTES`),
    forward and backward seconds, through memory: the cp - 1 merges of the output, the cp accumulations of
    the gradients."""
    tokens = local_tokens(config, job)
    queries = tokens * model.q_dim / config.tp
    keys = (
        tokens * kv_bytes(model, config.tp, 1, software.repeat_kv) / 2
    )  # the keys' elements (values': as many)
    forward = (config.cp - 1) * MERGE_FORWARD_BYTES * queries
    q_bytes, kv_each = MERGE_BACKWARD_BYTES
    backward = config.cp * (q_bytes * queries + 2 * kv_each * keys)
    return forward / gpu.memory_bandwidth, backward / gpu.memory_bandwidth


def working_bytes(model: PaperModel, config: Config, job: Job, software: Software) -> float:
    """What the exchange holds beyond the activations at its peak, in one layer's backward: the whole
    sequence's keys and values after an all-gather (a ring: two blocks); under torch's all-gather also
    what its backward holds at once (`backward_bytes`)."""
    if config.cp == 1 or model.kind == "mlp":
        return 0.0
    block = block_bytes(model, config, job, software)
    if software.cp_exchange == "ring":
        return 2 * block
    extra = backward_bytes(model, config, job, software) if software.cp_exchange == "all-gather" else 0.0
    return config.cp * block + extra


def backward_bytes(model: PaperModel, config: Config, job: Job, software: Software) -> float:
    """torch's ring backward's own buffers beside the gathered keys and values, all alive at its
    ``torch.cat`` of the gradients for the next send (``_templated_ring_attention_backward``): the local
    keys and values concatenated for the rotation (a block), their fp32 gradients three times (the one
    received, the one updated, the one concatenated to send), the kernel's block gradients of keys and
    values (a block) and of the queries, and the queries' fp32 gradient."""
    a = software.activation_bytes
    block = block_bytes(model, config, job, software)
    queries = local_tokens(config, job) * model.q_dim / config.tp  # elements
    return block * (2 + 3 * GRADIENT_BYTES / a) + queries * (a + GRADIENT_BYTES)


def refusal(model: PaperModel, job: Job, fixed: dict) -> str | None:
    """Why ``--fix cp=N`` cannot work, in one line, or None."""
    cp = fixed.get("cp", 1)
    if cp == 1:
        return None
    if model.kind == "mlp":
        return f"--fix cp={cp}: context parallel splits attention's sequence; this model has no attention"
    if job.seq_len % (2 * cp):
        return (f"--fix cp={cp}: --seq-len {job.seq_len} does not split into 2 x cp = {2 * cp} equal chunks "
                "(each cp rank holds two, for an even share of the causal attention)")  # fmt: skip
    return None
