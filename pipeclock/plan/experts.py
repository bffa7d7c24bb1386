"""Expert parallel on paper: a mixture's routed experts divided over ``ep`` ranks, and the all-to-all that
takes each token to its experts and back.

- **The mesh.** The expert groups are carved from the data-parallel ranks of a stage, as Megatron-Core and
  torchtitan carve them: ep divides dp and the expert count. A rank holds experts/ep of each MoE layer of
  its stage (split tp ways as before); everything else (attention, norms, the router, shared experts) is
  held as without ep. A cluster run lays the ep ranks just outside tp (Megatron-Core's order tp, ep, dp,
  pp), so a group holds ``gpus_per_node // tp`` ranks of a node; under pipeclock's order (dp outermost,
  `pipeclock.plan.group_link`) they sit a pipeline's pp x cp x tp ranks apart.
- **Memory.** The routed experts' weights, gradients and optimizer state are divided by ep; ZeRO shards
  them over the dp / ep ranks that hold the same experts (the expert-data-parallel group).
- **The all-to-all.** For each MoE layer and micro-batch, the forward dispatches each token's hidden state
  to the ranks of its top-k experts and combines their outputs back; the backward sends the combine's
  gradient to the experts and the dispatch's gradient back: four exchanges of top-k x tokens x hidden,
  each copy that leaves its rank crossing NVLink inside a node and the network between nodes (both at
  once; the slower sets the time). Routing is taken as even: (ep - 1) / ep of the copies leave. A model
  that routes each token to at most ``groups_per_token`` groups of experts (DeepSeek-V3's node-limited
  routing) is dispatched as its kernels do: a token crosses the network once per node it needs and is
  forwarded inside the node by NVLink. Under fp8 the copies sent to the experts go in fp8 and the ones
  coming back in bf16 (DeepSeek-V3 §3.3.2); else both in the activations' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipeclock.plan import calibration
from pipeclock.plan.cluster_config import DP_OUTERMOST, Config, Job, Software
from pipeclock.plan.gpus import GpuKind
from pipeclock.plan.paper_model import PaperModel

FP8_BYTES = 1


def shared_width(config) -> int:
    """A Hugging Face mixture's always-used experts, in total width: Qwen-MoE's
    ``shared_expert_intermediate_size``, or DeepSeek's ``n_shared_experts`` x ``moe_intermediate_size``."""
    width = getattr(config, "shared_expert_intermediate_size", 0) or 0
    if not width:
        shared = getattr(config, "n_shared_experts", 0) or 0
        width = shared * (getattr(config, "moe_intermediate_size", 0) or 0)
    return width


def routing_fields(config) -> dict:
    """The `PaperModel` fields of node-limited routing (DeepSeek's ``n_group`` and ``topk_group``)."""
    groups, chosen = getattr(config, "n_group", 0) or 0, getattr(config, "topk_group", 0) or 0
    if isinstance(groups, int) and isinstance(chosen, int) and 0 < chosen < groups:
        return {"expert_groups": groups, "groups_per_token": chosen}
    return {}


# --- the knob ------------------------------------------------------------------------------------------


def ep_choices(model: PaperModel, dp: int, fixed: dict) -> tuple[int, ...]:
    """The ep degrees a search tries for ``dp`` replicas: the fixed one where it divides dp, else every
    divisor of dp that divides the expert count (1 alone for a dense model)."""
    if "ep" in fixed:
        return (fixed["ep"],) if dp % fixed["ep"] == 0 else ()
    if not model.is_moe:
        return (1,)
    return tuple(e for e in range(1, dp + 1) if dp % e == 0 and model.experts % e == 0)


def refusal(model: PaperModel, fixed: dict) -> str | None:
    """Why ``--fix ep=N`` cannot work for ``model`` (one line), or None."""
    ep = fixed.get("ep", 1)
    if ep == 1:
        return None
    if not model.is_moe:
        return f"--fix ep={ep}: {model.name} is dense: expert parallel needs a mixture of experts"
    if model.experts % ep:
        return f"--fix ep={ep} does not divide the model's {model.experts} experts"
    if "dp" in fixed and fixed["dp"] % ep:
        return (
            f"--fix ep={ep} does not divide dp={fixed['dp']}: the expert groups are carved from the "
            "data-parallel ranks"
        )
    return None


# --- memory --------------------------------------------------------------------------------------------


def routed_parameters(model: PaperModel) -> int:
    """One MoE layer's routed experts' parameters (all of them, whole); 0 for a dense model."""
    if not model.is_moe:
        return 0
    h, ffn = model.hidden, model.ffn
    up = 2 if model.gated else 1
    bias = (up * ffn + h) if model.linear_bias else 0
    return model.experts * (h * up * ffn + ffn * h + bias)


def moved_per_layer(model: PaperModel, config: Config) -> float:
    """The routed parameters of one layer that a tp rank no longer holds under ep: all but its 1/ep."""
    return routed_parameters(model) / config.tp * (1 - 1 / config.ep)


def split_states(
    states, model: PaperModel, config: Config, software: Software, parameters: float, layers: int,
    expert_layers: int | None = None,
):  # fmt: skip
    """Weights, gradients and optimizer state of ``parameters`` (``layers`` blocks, ``expert_layers`` of
    them with experts, all by default; as held without ep) on one GPU under ``config.ep``: ``states``
    (`cluster_memory`'s rule) applied to the rest as before and to the rank's own experts over the
    expert-data-parallel group (dp / ep ranks)."""
    if config.ep == 1 or not model.is_moe:
        return states(model, config, software, parameters, layers)
    routed = (layers if expert_layers is None else expert_layers) * routed_parameters(model) / config.tp
    rest = states(model, config, software, parameters - routed, layers)
    own = states(model, replace(config, dp=config.dp // config.ep), software, routed / config.ep, layers)
    return tuple(a + b for a, b in zip(rest, own, strict=True))


def parameters_per_pipeline(model: PaperModel, config: Config) -> float:
    """The parameters one pipeline's ranks hold together under ep (the whole model without it)."""
    expert_layers = model.layers - model.dense_among(range(model.layers))
    return model.parameters() - expert_layers * moved_per_layer(model, config) * config.tp


# --- the all-to-all ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One MoE layer's all-to-alls for one micro-batch on one GPU: the copies of a token that leave the
    GPU inside its node and to other nodes, and the seconds of the forward's dispatch and combine and of
    the backward's two (the same bytes, the other way)."""

    inside: float  # copies per token, over NVLink
    between: float  # copies per token, over the network
    bytes_forward: float  # what leaves the GPU in the forward (dispatch + combine)
    forward: float
    backward: float


NO_EXCHANGE = Exchange(0.0, 0.0, 0.0, 0.0, 0.0)


def copies(model: PaperModel, ep: int, apart: int, gpu: GpuKind) -> tuple[float, float]:
    """Per token, the copies of its hidden state that leave its GPU for the ep group's other ranks, which
    sit ``apart`` ranks from each other: (inside the node, to other nodes); see the module's rules."""
    local = max(1, min(ep, gpu.gpus_per_node // apart))
    nodes = math.ceil(ep / local)
    k = model.experts_per_token
    inside, between = k * (local - 1) / ep, k * (ep - local) / ep
    if model.groups_per_token and nodes > 1:
        touched = min(nodes, model.groups_per_token * max(1, nodes // max(1, model.expert_groups)))
        once = touched * (nodes - 1) / nodes  # one copy a node, forwarded inside it on arrival
        if once < between:
            inside, between = inside + between, once
    return inside, between


def exchange(model: PaperModel, config: Config, job: Job, software: Software, gpu: GpuKind) -> Exchange:
    """One MoE layer's all-to-alls for one micro-batch (the module's rules); nothing without ep."""
    if config.ep == 1 or not model.is_moe:
        return NO_EXCHANGE
    apart = config.tp * config.cp * (config.pp if software.rank_order == DP_OUTERMOST else 1)
    inside, between = copies(model, config.ep, apart, gpu)  # the ep ranks' distance (the module's rules)
    tokens = config.microbatch_size * job.seq_len / config.cp / config.tp  # each rank sends its tokens
    back = software.activation_bytes
    out = FP8_BYTES if software.dtype == "fp8" else back
    nvlink = gpu.intra_node_bandwidth * calibration.LINK_EFFICIENCY
    network = gpu.inter_node_bandwidth * calibration.LINK_EFFICIENCY

    def one(element_bytes: float) -> float:
        volume = tokens * model.hidden * element_bytes
        return max(inside * volume / nvlink, between * volume / network) + calibration.COLLECTIVE_LATENCY

    seconds = one(out) + one(back)
    moved = tokens * model.hidden * (inside + between) * (out + back)
    return Exchange(inside, between, moved, seconds, seconds)
