"""Step time of a cluster configuration, on paper: each action's cost, then the program simulator.

One micro-batch through one layer on one GPU costs, forward:

- the matrix products: FLOPs at the GPU kind's ``gemm_efficiency`` of the dense peak (scaled by each
  product's size, `pipeclock.plan.gemm_efficiency`), plus their operands' trip through memory at the
  memory's bandwidth (what makes small products less efficient than large);
- attention: its FLOPs (the causal half) at ``ATTENTION_SHARE`` of the products' speed;
- the elementwise operations: ``ELEMENTWISE_PASSES`` times the bytes the layer keeps, through memory;
- tensor parallel: two collectives of the layer's activations (all-reduces, or with sequence parallel an
  all-gather and a reduce-scatter each) on the node's link; hidden in part when the run overlaps them.

The backward costs twice the products and the elementwise work, 2.5 times attention (its kernel computes
five products for the forward's two), the same collectives again (less what runs under the weight
gradients when ``Software.tp_backward_overlap``), and whatever recompute runs again;
split into I and W, W is the weight-gradient products alone. A stage's action is its layers' sum, the
embedding on the first stage and the head and loss on the last (the loss at the bytes a logit was
measured to move, ``LOSS_BYTES``). The pipeline's step is then what
``pipeclock.observe.simulate`` makes of the schedule's program with these costs and the stage-to-stage
messages on their link (the same simulator as the measured planner's, cached by the costs' ratios). The
data-parallel collectives are laid along the simulated timeline (`data_parallel_seconds`), and the
optimizer's pass over its states comes last. The constants are `pipeclock.plan.calibration`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeclock.plan import (
    activations,
    attention_core,
    calibration,
    context_parallel,
    experts,
    gemm_efficiency,
    group_link,
    recompute_tail,
    zero3_time,
)
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import (
    layer_parameters_per_gpu,
    placement_for,
    stage_layers,
    untied_head_parameters,
)
from pipeclock.plan.gpus import GpuKind
from pipeclock.plan.paper_model import PaperModel
from pipeclock.plan.pipeline_time import Simulated, _round, as_simulated_at_least, simulated

OPTIMIZER_BYTES = 30  # per fp32 parameter of an Adam step: read weight, grad, moments; write them, copy


@dataclass(frozen=True)
class LayerTime:
    """One layer, one micro-batch, on one GPU, in seconds."""

    forward: float
    input_grad: float
    weight_grad: float
    recompute: float  # run again before the backward
    tp: float  # of the forward and of the backward each: tensor parallel's exposed collectives
    exchange_forward: float = 0.0  # expert parallel's all-to-alls (`pipeclock.plan.experts`), in forward
    exchange_backward: float = 0.0  # and in the input-gradient backward


@dataclass(frozen=True)
class StepTime:
    """A step's seconds, and where they went on the busiest rank."""

    step: float
    pipeline: float  # the simulated program: compute, messages, the bubble
    bubble: float  # share of the pipeline's rank-time spent idle
    compute: float  # the busiest rank's actions, recompute and tp collectives included
    recompute: float
    tp: float
    dp: float  # data-parallel collectives not hidden
    optimizer: float
    ep: float = 0.0  # expert parallel's all-to-alls on the busiest rank, hidden or not


class Rates:
    """A GPU kind's effective speeds for a run's dtype."""

    def __init__(self, gpu: GpuKind, software: Software):
        fp8 = software.dtype == "fp8"
        framework = calibration.DEEPSPEED_SHARE if software.deepspeed else 1.0
        plain = gpu.peak("fp32" if software.dtype == "fp32" else "bf16") * gpu.gemm_efficiency * framework
        fp8_efficiency = gpu.fp8_gemm_efficiency or gpu.gemm_efficiency * calibration.FP8_SHARE
        self.gemm = gpu.peak("fp8") * fp8_efficiency * framework if fp8 else plain
        self.attention = plain * calibration.ATTENTION_SHARE
        self.memory = gpu.memory_bandwidth
        self.a = software.activation_bytes
        self.gpu = gpu
        self.rank_order = software.rank_order
        self.per_layer: dict[tuple, tuple] = {}  # a search asks for the same layer's costs often
        self.per_stages: dict[tuple, list] = {}
        self.stage_parameters: dict[tuple, list] = {}
        self.stage_shapes: dict[tuple, tuple] = {}


def layer_time(model: PaperModel, config: Config, job: Job, software: Software, rates: Rates) -> LayerTime:
    """One layer's costs for one micro-batch (the module's rules), on one of its cp ranks."""
    tokens = context_parallel.local_tokens(config, job)
    tp, a = config.tp, rates.a
    each = [(g, _gemm_seconds(g, tokens, model, tp, a, rates)) for g in model.gemms()]
    products = sum(seconds for _, seconds in each)
    attention = model.attention_flops(job.seq_len) * tokens / tp / rates.attention
    kept = activations.layer_bytes(model, "none", a, software.fused, tp, config.sequence_parallel)
    passes = calibration.ELEMENTWISE_PASSES["fused" if software.fused else "eager"]
    elementwise = passes * kept * tokens / rates.memory
    half = _tp_collective(model, config, tokens, software, rates)
    collectives = half * (0.5 if model.kind == "mlp" else 2.0)
    exchange = experts.exchange(model, config, job, software, rates.gpu)
    scores = attention_core.score_seconds(model, config, job, software, rates)
    kv = context_parallel.exchange(model, config, job, software, rates.gpu, attention)
    forward = products + attention + scores + elementwise + collectives + exchange.forward + kv.forward
    again = {
        "none": 0.0,
        "selective-attention": attention + scores,
        "selective-op": elementwise + sum(seconds for g, seconds in each if not g.kept),
        "full": forward - recompute_tail.skipped_seconds(model, each, half, config, software),
    }[config.recompute]
    exposed = collectives - _backward_hidden(collectives, each, software)
    backward = products + 2.5 * attention + 2 * (elementwise + scores) + exposed + again + kv.backward
    return LayerTime(
        forward=forward,
        input_grad=backward + exchange.backward,
        weight_grad=products,
        recompute=again,
        tp=collectives,
        exchange_forward=exchange.forward,
        exchange_backward=exchange.backward,
    )


def _backward_hidden(collectives: float, each: list, software: Software) -> float:
    """What of the backward's tp collectives runs under the column-parallel products' weight gradients
    (``Software.tp_backward_overlap``): at most those products' time, which equals their forward's."""
    if not software.tp_backward_overlap:
        return 0.0
    return min(collectives, sum(seconds for gemm, seconds in each if gemm.split == "n"))


def _gemm_seconds(gemm, tokens: int, model: PaperModel, tp: int, a: int, rates: Rates) -> float:
    k, n = gemm.k, gemm.n
    if gemm.split == "k":
        k = k / tp
    elif gemm.split == "n":
        n = activations.output_width(model, gemm, tp, sp=False)
    flops = 2.0 * tokens * k * n * gemm.count
    moved = (tokens * (k + n) * gemm.count + k * n * min(gemm.count, model.experts or 1)) * a
    share = gemm_efficiency.size_factor(k, n, gemm_efficiency.half_size(rates.gpu.name))
    return flops / (rates.gemm * share) + moved / rates.memory


def _tp_collective(model: PaperModel, config: Config, tokens: int, software: Software, rates: Rates) -> float:
    """One all-reduce of a micro-batch's activations among the tp ranks (or an all-gather plus a
    reduce-scatter, the same bytes; under fp8 the all-gather's in fp8), as exposed: the part the run does
    not overlap."""
    if config.tp == 1:
        return 0.0
    volume = tokens * model.hidden * rates.a
    if software.dtype == "fp8" and config.sequence_parallel:  # the all-gathers carry the products' fp8
        volume *= 0.75  # inputs (Transformer Engine's, torchao's Float8ColwiseParallel); reduce-scatters bf16
    share = 2.0 * (config.tp - 1) / config.tp
    link = rates.gpu.intra_node_bandwidth * calibration.LINK_EFFICIENCY
    calls = 2 if config.sequence_parallel else 1
    seconds = share * volume / link + calls * calibration.COLLECTIVE_LATENCY
    return seconds * ((1 - calibration.TP_OVERLAP_HIDDEN) if software.tp_overlap else 1.0)


def stage_costs(model, config, job, software, rates) -> list[dict[str, float]]:
    """Each virtual stage's F, B, I, W for one micro-batch: its layers, plus the embedding (first) and
    the head with the loss (last). Cached on ``rates``: the caller must not change them."""
    key = _layer_key(model, config, job, software)
    cached = rates.per_stages.get((key, config.pp, config.chunks, config.ends))
    if cached is not None:
        return cached
    own, ends = _layer_and_ends(model, config, job, software, rates)  # read once for all the stages
    cuts = stage_layers(model, config)
    shapes = rates.stage_shapes.get((model, len(cuts), config.ends))
    if shapes is None:  # the cut depends on the count of stages and where the ends go alone
        shapes = rates.stage_shapes[(model, len(cuts), config.ends)] = _stage_shapes(model, cuts)
    made: dict[tuple, dict[str, float]] = {}
    for shape, kinds in shapes[1].items():  # stages alike cost alike
        first, last = shape[1:]
        cost = dict.fromkeys(("F", "I", "W", "xF", "xB"), 0.0)  # xF, xB: inside F, and B or I
        for block, n in kinds:
            layer = own if block is model else _layer_and_ends(block, config, job, software, rates)[0]
            cost["F"] += n * layer.forward
            cost["I"] += n * layer.input_grad
            cost["W"] += n * layer.weight_grad
            cost["xF"] += n * layer.exchange_forward
            cost["xB"] += n * layer.exchange_backward
        for end, applies in (("first", first), ("last", last)):
            if applies:
                for op in ("F", "I", "W"):
                    cost[op] += ends[end][op]
        cost["B"] = cost["I"] + cost["W"]
        if len(cuts) == 1:  # ZeRO-3 on one stage times its block-by-block collectives (`zero3_time`)
            cost["block"] = (layer.forward, layer.input_grad + layer.weight_grad)
            cost["ends"] = tuple(ends[end][op] for end in ("first", "last") for op in ("F", "B"))
        made[shape] = cost
    costs = [dict(made[shape]) for shape in shapes[0]]
    rates.per_stages[(key, config.pp, config.chunks, config.ends)] = costs
    return costs


def _stage_shapes(model: PaperModel, cuts: list[range]) -> tuple[list[tuple], dict[tuple, list]]:
    """Each stage's shape (its count of each kind of block, whether it is the first, the last), and each
    shape's `blocks`: stages of one shape cost the same."""
    shapes, kinds_of = [], {}
    for index, cut in enumerate(cuts):
        kinds = blocks(model, cut)
        shape = (tuple(n for _, n in kinds), index == 0, index == len(cuts) - 1)
        shapes.append(shape)
        kinds_of.setdefault(shape, kinds)
    return shapes, kinds_of


def blocks(model: PaperModel, cut: range) -> list[tuple[PaperModel, int]]:
    """The kinds of block among the layers ``cut`` and how many of each: the model's own, and the dense
    first blocks of a mixture that has them (as their `PaperModel.dense_twin`)."""
    dense = model.dense_among(cut)
    return [(model, len(cut) - dense)] + ([(model.dense_twin(), dense)] if dense else [])


def _layer_key(model, config, job, software) -> tuple:
    """What a layer's costs depend on: its all-to-all on ep, its exchange of keys and values on cp."""
    return (model, config.tp, config.sequence_parallel, config.recompute, config.microbatch_size, job,
            software, config.cp, config.ep)  # fmt: skip


def _layer_and_ends(model, config, job, software, rates) -> tuple[LayerTime, dict]:
    key = _layer_key(model, config, job, software)
    if key not in rates.per_layer:
        tokens = context_parallel.local_tokens(config, job)
        ends = _ends(model, config, tokens, software, rates)
        rates.per_layer[key] = layer_time(model, config, job, software, rates), ends
    return rates.per_layer[key]


def work_floor(model, config: Config, job: Job, software: Software, rates: Rates) -> float:
    """A cheap floor on the step, with no schedule read: the pipeline's work spread evenly over its
    ranks, plus the optimizer (`pipeline_floor` is tighter and costs more). The experts' all-to-alls are
    left out: a schedule that pairs a forward with a backward (DualPipeV) hides them."""
    ends = _layer_and_ends(model, config, job, software, rates)[1]
    work = exchange = 0.0
    for block, n in blocks(model, range(model.layers)):
        layer = _layer_and_ends(block, config, job, software, rates)[0]
        exchange += n * (layer.exchange_forward + layer.exchange_backward)
        work += n * (layer.forward + layer.input_grad + layer.weight_grad)
    work += sum(ends[end][op] for end in ("first", "last") for op in ("F", "I", "W"))
    pipeline = config.microbatches * as_simulated_at_least(work, exchange) / config.pp
    return pipeline + optimizer_seconds(model, config, rates)


def _ends(model, config, tokens, software, rates) -> dict[str, dict[str, float]]:
    """The embedding's and the head's (with the loss) costs for one micro-batch."""
    if model.kind == "mlp":
        nothing = {"F": 0.0, "I": 0.0, "W": 0.0, "B": 0.0}
        return {"first": nothing, "last": nothing}
    tp, a, h, vocab = config.tp, rates.a, model.hidden, model.vocab
    collective = _tp_collective(model, config, tokens, software, rates)
    lookup = 2 * tokens * h * a / rates.memory
    first = {"F": lookup + collective, "I": 0.0, "W": vocab * h / tp * 4 / rates.memory + lookup}
    moved = (tokens * (h + vocab / tp) + h * vocab / tp) * a
    product = 2.0 * tokens * h * vocab / tp / rates.gemm + moved / rates.memory
    forward, backward = loss_seconds(tokens * vocab / tp, rates)
    last = {"F": product + forward + collective, "I": product + backward + collective, "W": product}
    for end in (first, last):
        end["B"] = end["I"] + end["W"]
    return {"first": first, "last": last}


def loss_seconds(logits: float, rates: Rates) -> tuple[float, float]:
    """The loss's forward and backward over ``logits`` (tokens x vocabulary on one tp rank): their trips
    through memory, ``calibration.LOSS_BYTES`` a logit as measured, at the memory's bandwidth."""
    moved = calibration.LOSS_BYTES
    return logits * moved["forward"] / rates.memory, logits * moved["backward"] / rates.memory


def message_seconds(model, config, job, rates) -> float:
    """What one stage-to-stage message costs: an activation (or its gradient) of one micro-batch, split
    over the tp ranks, on the node's link or, past a node, the network. Without sequence parallel each
    tp rank holds the whole activation, sends its 1/tp share and gathers the rest from its node's
    ranks on arrival (Megatron-LM's scatter/gather, Narayanan et al. 2021 section 4.1). A cp rank sends its
    own tokens to the next stage's same cp rank."""
    tokens = context_parallel.local_tokens(config, job)
    whole = tokens * model.hidden * rates.a
    crosses_nodes = group_link.message_crosses_nodes(config, rates.gpu, rates.rank_order)
    link = rates.gpu.inter_node_bandwidth if crosses_nodes else rates.gpu.intra_node_bandwidth
    seconds = calibration.COLLECTIVE_LATENCY + whole / config.tp / (link * calibration.LINK_EFFICIENCY)
    if config.tp > 1 and not config.sequence_parallel:
        gather = whole * (config.tp - 1) / config.tp
        node = rates.gpu.intra_node_bandwidth * calibration.LINK_EFFICIENCY
        seconds += calibration.COLLECTIVE_LATENCY + gather / node
    return seconds


def pipeline_seconds(model, config, job, software, rates, costs) -> tuple[Simulated, float]:
    """The simulated program for these stage costs, and the unit of its times in seconds."""
    unit = max(cost["F"] for cost in costs) or 1.0
    key = tuple(tuple(_round(cost[op] / unit) for op in ("F", "B", "I", "W", "xF", "xB")) for cost in costs)
    transfer = _round(message_seconds(model, config, job, rates) / unit)
    return simulated(config.schedule, config.pp, config.microbatches, config.chunks, key, transfer), unit


def step_time(model, config: Config, job: Job, software: Software, gpu: GpuKind) -> StepTime:
    """The step's seconds (the module's rules), with where they went on the busiest rank."""
    rates = Rates(gpu, software)
    costs = stage_costs(model, config, job, software, rates)
    run, unit = pipeline_seconds(model, config, job, software, rates, costs)
    pipeline = run.makespan * unit
    layer = layer_time(model, config, job, software, rates)
    per_microbatch = model.layers / config.pp * config.microbatches
    dp = data_parallel_seconds(model, config, software, rates, costs, run, unit)
    optimizer = optimizer_seconds(model, config, rates)
    return StepTime(
        step=pipeline + dp + optimizer,
        pipeline=pipeline,
        bubble=run.bubble,
        compute=busiest_compute(config, costs),
        recompute=per_microbatch * layer.recompute,
        tp=per_microbatch * layer.tp * (3 if config.recompute == "full" else 2),
        dp=dp,
        optimizer=optimizer,
        ep=per_microbatch * (layer.exchange_forward + layer.exchange_backward),
    )


def busiest_compute(config: Config, costs: list[dict[str, float]]) -> float:
    """The most compute any rank does in a step."""
    placement = placement_for(config.schedule, config.pp, config.chunks)
    return config.microbatches * max(
        sum(costs[s]["F"] + costs[s]["B"] for s in stages) for stages in placement.stages
    )


def optimizer_seconds(model: PaperModel, config: Config, rates: Rates) -> float:
    """Adam's pass over the states a GPU updates (its shard of them under ZeRO)."""
    held = model.parameters() if config.zero >= 1 else experts.parameters_per_pipeline(model, config)
    parameters = held / (config.pp * config.tp)  # under ZeRO, a rank's share of the experts is 1/dp anyway
    return parameters * OPTIMIZER_BYTES / (config.replicas if config.zero >= 1 else 1) / rates.memory


def data_parallel_seconds(model, config, software, rates, costs, run: Simulated | None, unit: float) -> float:
    """What the data-parallel collectives add to the step, on the rank they delay most.

    Each stage's gradients leave for the replicas as its last backward runs (layer by layer, so the last
    layer's share waits for its end), one stage after another on the link; the step ends when the last
    arrive. Under ZeRO 1-3 the updated weights come back by all-gather, each stage's before its first
    forward finishes, stage after stage from the step's start. ZeRO-3 on one stage gathers every
    layer's weights for each forward and backward, ahead of the layer that needs them, and reduces each
    micro-batch's gradients, as ZeRO-2 does (its gradients are never whole). Without ``run``
    (a floor for the search), only that last case counts: the others may all be hidden.
    """
    per_microbatch = (config.zero == 3 and config.pp == 1) or (config.zero == 2 and config.microbatches > 1)
    if config.replicas == 1 or (run is None and not per_microbatch):
        return 0.0
    link = group_link.bandwidth(config, rates.gpu, software) * calibration.LINK_EFFICIENCY  # k NICs a node
    share = (config.replicas - 1) / config.replicas  # dp x cp ranks hold the same weights
    sync = 2 * share if config.zero == 0 else share  # an all-reduce moves twice a reduce-scatter's bytes
    weight_bytes = 2 if software.dtype != "fp32" else 4
    cuts = stage_layers(model, config)
    shape = (
        model,
        config.tp,
        config.pp,
        config.chunks,
        config.ep,
        config.ends,
    )  # ep: the experts a rank holds
    if shape not in rates.stage_parameters:
        rates.stage_parameters[shape] = [_stage_parameters(model, config, s, cuts) for s in range(len(cuts))]
    stage_parameters = rates.stage_parameters[shape]
    gradients = [sync * n * 4 / link + calibration.COLLECTIVE_LATENCY for n in stage_parameters]
    weights = [share * n * weight_bytes / link if config.zero >= 1 else 0.0 for n in stage_parameters]
    if config.zero == 3 and config.pp == 1:  # each block's gathers and reduce-scatter, as FSDP2 runs them
        blocks = zero3_time.units(
            model.layers,
            costs[0]["block"],
            costs[0]["ends"],
            _unit_parameters(model, config),
            (share * weight_bytes / link, sync * 4 / link),
            calibration.COLLECTIVE_LATENCY,
        )
        return config.microbatches * zero3_time.microbatch_exposed(blocks)
    if config.zero == 2 and config.microbatches > 1:  # each micro-batch's gradients leave as they come
        return config.microbatches * max(max(0.0, g - c["B"]) for g, c in zip(gradients, costs, strict=True))
    layers = [max(1, len(cut)) for cut in cuts]
    end, delay = run.makespan * unit, 0.0
    for moments in run.moments:
        free = 0.0
        for stage, _, start, finish in sorted(moments, key=lambda m: m[2]):
            free = max(free, start * unit) + gradients[stage]
            free = max(free, finish * unit + gradients[stage] / layers[stage])
        end = max(end, free)
        gathered = 0.0
        for stage, first, _, _ in sorted(moments, key=lambda m: m[1]):
            gathered += weights[stage]
            needed = first * unit + costs[stage]["F"] * (1 - 1 / layers[stage])
            delay = max(delay, gathered - needed)
    return end - run.makespan * unit + delay


def _unit_parameters(model: PaperModel, config: Config) -> tuple[float, float, float]:
    """The parameters one tp rank gathers for the embedding, for a block and for the head."""
    block = layer_parameters_per_gpu(model, config.tp) - experts.moved_per_layer(model, config)
    head = untied_head_parameters(model)  # a tied head is gathered with the embedding
    return model.embedding_parameters() / config.tp, block, head / config.tp


def _stage_parameters(model: PaperModel, config: Config, stage: int, cuts) -> float:
    """The parameters of one virtual stage on one tp rank (its layers, and the ends it carries)."""
    total = sum(
        n * (layer_parameters_per_gpu(block, config.tp) - experts.moved_per_layer(block, config))
        for block, n in blocks(model, cuts[stage])
    )
    if stage == 0:
        total += model.embedding_parameters() / config.tp
    if stage == len(cuts) - 1:
        total += model.head_parameters() / config.tp
    return total
