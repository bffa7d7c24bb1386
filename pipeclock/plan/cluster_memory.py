"""Memory per GPU of a cluster configuration, on paper: the fullest GPU's bytes, part by part.

- weights: fp32 masters, plus (bf16, fp8) the compute copy the forwards use; ZeRO-3 keeps 1/dp of the
  masters and gathers the compute copy of the layers it runs (two at a time: this one and the next; a
  pipeline stage keeps its whole stage gathered through the step, as torchtitan does under PP); under
  Transformer Engine's fp8 with bf16 weights, each block matrix's fp8 cast and its transpose beside them
  (`Software.fp8_weight_copy_bytes`; with fp8 weights, those two are the compute copy);
- gradients (fp32) and Adam's two moments (fp32), each 1/dp where the ZeRO stage shards them; under
  DeepSpeed's BF16_Optimizer (``Software.gradients``) the bf16 gradients too, whole (ZeRO 0-2);
- activations: the micro-batches each rank holds at once under its schedule (read off the schedule's
  own order of actions: from a micro-batch's F until its last backward), times what a micro-batch keeps
  on the rank's stages (`pipeclock.plan.activations`); the head's on the rank holding the last stage;
- working memory: the larger of the head's backward (the logits' gradient) and one layer's backward,
  what context parallel holds there (`context_parallel.working_bytes`) with, under full recompute, the
  layer's forward rebuilt; plus the receive buffers of the next activation and gradient;
- an allowance for what the allocator reserves beyond what is allocated (``ALLOCATOR_SLACK``) and for
  the CUDA context, the collectives' buffers and the library workspaces (``RUNTIME_BYTES``).

Under torch's pipeline stages (``Software.pipelining``), which keep every output and a receive buffer a
micro-batch and, under FSDP2, take a stage's gradients at its first backward, each rank is walked along
its own actions instead (`pipeclock.plan.stage_buffers`).

Tensor parallel divides each stage's matrices by tp (norm weights are replicated) and the embedding and
head by tp (vocabulary-parallel); a tied matrix is held once where one rank holds both ends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pipeclock.engine.actions import placement_of
from pipeclock.engine.generators import V_SCHEDULES
from pipeclock.engine.placement import Placement
from pipeclock.models.partition import partition
from pipeclock.plan import activations, calibration, context_parallel, experts, stage_buffers
from pipeclock.plan.cluster_config import GRADIENTS, Config, Job, Software
from pipeclock.plan.paper_model import PaperModel
from pipeclock.plan.pipeline_replay import schedule_table

MASTER_BYTES, GRADIENT_BYTES, ADAM_BYTES = 4, 4, 8


@dataclass(frozen=True)
class GpuMemory:
    """The fullest GPU's memory, by part, in bytes; ``total`` adds the allowance."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    working: float

    @property
    def allocated(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.working

    @property
    def total(self) -> float:
        return self.allocated * (1.0 + calibration.ALLOCATOR_SLACK) + calibration.RUNTIME_BYTES

    @property
    def parts(self) -> dict[str, float]:
        return {
            "weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
            "activations": self.activations, "working": self.working,
            "allowance": self.total - self.allocated,
        }  # fmt: skip


def stage_layers(model: PaperModel, config: Config) -> list[range]:
    """The layers of each virtual stage: the blocks cut evenly (`partition`); the embedding is on the
    first stage and the head on the last, riding with their blocks or, ``config.ends == "slot"``, in a
    block's slot each (the first and the last stages a block fewer; either may hold no block)."""
    return _cut(model.layers, config.pp * config.chunks, config.ends == "slot")


@functools.lru_cache(maxsize=4096)
def _cut(layers: int, stages: int, ends_in_slots: bool = False) -> list[range]:
    if not ends_in_slots:
        return partition(layers, stages)
    slots = partition(layers + 2, stages)  # slot 0 the embedding, slot layers + 1 the head
    return [range(max(0, s.start - 1), min(layers, s.stop - 1)) for s in slots]


def most_virtual_stages(model: PaperModel, ends: str = "ride") -> int:
    """The most virtual stages a cut allows: one block each, and with the ends in slots, one end each."""
    return model.layers + (2 if ends == "slot" else 0)


@functools.lru_cache(maxsize=1024)
def placement_for(schedule: str, pp: int, chunks: int) -> Placement:
    """Which virtual stages each rank holds (the same for every micro-batch count): the V's for a V
    schedule, else the loop; a test holds it to the generator's own, which a long V takes a while to
    give."""
    return Placement.v(pp) if schedule in V_SCHEDULES else Placement.loop(pp, chunks)


@functools.lru_cache(maxsize=4096)
def held_microbatches(
    schedule: str, pp: int, microbatches: int, chunks: int, layers: tuple[tuple[int, ...], ...] | None = None
) -> tuple[tuple[int, int, int], ...]:
    """Per rank: the most (micro-batch, stage) pairs it holds at once, the most of them on the last
    virtual stage (whose head keeps the logits), and the most blocks' activations it holds at once, with
    ``layers[rank][chunk]`` blocks in each of its chunks (None: one each); from the schedule's own order
    of actions.

    A schedule that bounds what it holds reaches its bound after a few rounds of warm-up: when the
    counts at ``HELD_SETTLED`` rounds and twice that agree, they hold for any longer step too (a test
    checks it on every schedule), and a long step is not generated."""
    settled = HELD_SETTLED * pp * chunks
    if microbatches > 2 * settled:
        short = _held(schedule, pp, settled, chunks, layers)
        if short == _held(schedule, pp, 2 * settled, chunks, layers):
            return short
    return _held(schedule, pp, microbatches, chunks, layers)


HELD_SETTLED = 1  # rounds of pp x chunks micro-batches after which a bounded schedule holds its most


@functools.lru_cache(maxsize=4096)
def _held(
    schedule: str, pp: int, microbatches: int, chunks: int, layers: tuple | None = None
) -> tuple[tuple[int, int, int], ...]:
    table = schedule_table(schedule, pp, microbatches, chunks)  # shared with the step's simulation
    placement = placement_of(table)
    last = placement.num_virtual - 1
    result = []
    for rank, actions in enumerate(table):
        live, live_last, most, most_last = 0, 0, 0, 0
        chunks_last = {c for c in range(len(placement.stages[rank])) if placement.stage(rank, c) == last}
        backward_done = {(a.microbatch, a.chunk): i for i, a in enumerate(actions) if a.op in ("B", "W")}
        for index, action in enumerate(actions):
            if action.op == "F":
                live += 1
                live_last += action.chunk in chunks_last
                most, most_last = max(most, live), max(most_last, live_last)
            elif backward_done.get((action.microbatch, action.chunk)) == index:
                live -= 1
                live_last -= action.chunk in chunks_last
        blocks = most if layers is None else _most_blocks(actions, backward_done, layers[rank])
        result.append((most, most_last, blocks))
    return tuple(result)


def _most_blocks(actions, backward_done: dict, weight: tuple[int, ...]) -> int:
    """The most blocks' activations one rank holds at once, chunk c holding ``weight[c]`` blocks."""
    live = most = 0
    for index, action in enumerate(actions):
        if action.op == "F":
            live += weight[action.chunk]
            most = max(most, live)
        elif backward_done.get((action.microbatch, action.chunk)) == index:
            live -= weight[action.chunk]
    return most


def gpu_memory(model: PaperModel, config: Config, job: Job, software: Software) -> GpuMemory:
    """The memory of the fullest GPU under ``config`` (the module's list, part by part)."""
    cuts = stage_layers(model, config)
    placement = placement_for(config.schedule, config.pp, config.chunks)
    table_shape = (config.schedule, config.pp, config.microbatches, config.chunks)
    held = held_microbatches(*table_shape, _uneven_chunks(cuts, placement))
    last = placement.owner(placement.num_virtual - 1)[0]
    layers = [sum(len(cuts[s]) for s in stages) for stages in placement.stages]
    # the fullest is one of these: the first, the last stage's, the one holding most, the largest
    candidates = {0, last, max(range(config.pp), key=lambda r: held[r][0]), layers.index(max(layers))}
    candidates.add(max(range(config.pp), key=lambda r: held[r][2]))
    walk = walks(config, software)  # torch's stages: any rank may be the fullest
    return max(
        (
            _rank_memory(model, config, job, software, cuts, rank, held[rank], placement, walk)
            for rank in (range(config.pp) if walk else candidates)
        ),
        key=lambda memory: memory.allocated,
    )


def _uneven_chunks(cuts: list[range], placement: Placement) -> tuple[tuple[int, ...], ...] | None:
    """Each rank's blocks per chunk where the chunks differ (the ends in slots, a cut that does not
    divide), for `held_microbatches` to count the blocks held; None where all are alike."""
    layers = tuple(tuple(len(cuts[s]) for s in stages) for stages in placement.stages)
    return None if len({n for rank in layers for n in rank}) == 1 else layers


def memory_floor(model: PaperModel, config: Config, job: Job, software: Software) -> float:
    """A total `gpu_memory` cannot be under, without generating the schedule: the first rank, the last
    stage's and the one with most layers, each holding a single micro-batch (every rank holds at least
    the one it runs forward until its backward). Floats round monotonically, so the bound holds to the
    bit; a search judges a configuration over it too large without reading its schedule. Under torch's
    stages (`walks`), which hold gradients and buffers by the action, the floor is what no action
    changes: the weights, the optimizer state and the working memory without the receive buffers."""
    cuts = stage_layers(model, config)
    placement = placement_for(config.schedule, config.pp, config.chunks)
    last = placement.owner(placement.num_virtual - 1)[0]
    layers = [sum(len(cuts[s]) for s in stages) for stages in placement.stages]
    ranks = [_rank_memory(model, config, job, software, cuts, rank, (1, 1, None), placement) for rank in
             {0, last, layers.index(max(layers))}]  # fmt: skip
    if walks(config, software):
        messages = 2.0 * _message(model, config, software) * context_parallel.local_tokens(config, job)
        ranks = [GpuMemory(m.weights, 0.0, m.optimizer, 0.0, m.working - messages) for m in ranks]
    return max(memory.total for memory in ranks)


def _parameters(model, config, cuts, stages) -> tuple[float, int, int]:
    """The parameters of ``stages`` on one GPU, their blocks, and the dense ones among them."""
    first, last = 0 in stages, config.pp * config.chunks - 1 in stages
    layers = sum(len(cuts[s]) for s in stages)
    dense = sum(model.dense_among(cuts[s]) for s in stages)  # a mixture's dense first blocks
    parameters = (layers - dense) * layer_parameters_per_gpu(model, config.tp)
    parameters += dense * layer_parameters_per_gpu(model.dense_twin(), config.tp) if dense else 0
    parameters += (model.embedding_parameters() / config.tp) if first else 0
    if last and not (first and model.tied):
        parameters += model.head_parameters() / config.tp
    return parameters, layers, dense


def _rank_memory(model, config, job, software, cuts, rank, held, placement, walk=False) -> GpuMemory:
    """One rank's memory; ``walk``: torch's stages (``software.pipelining``) walked along its actions."""
    stages = placement.stages[rank]
    last_stage = config.pp * config.chunks - 1
    last = last_stage in stages
    parameters, layers, dense = _parameters(model, config, cuts, stages)
    weights, gradients, optimizer = experts.split_states(
        _states, model, config, software, parameters, layers, layers - dense
    )
    if config.zero == 3 and config.pp == 1:  # FSDP2 keeps its root (embedding, head) gathered from the
        # forward to the backward (`zero3_time`)
        weights += _root_parameters(model, config.tp) * (MASTER_BYTES if software.dtype == "fp32" else 2)
    weights += _fp8_copies(model, config, software, layers, dense)
    tokens = context_parallel.local_tokens(config, job)  # a cp rank's share of the micro-batch
    a, fused, tp, sp = software.activation_bytes, software.fused, config.tp, config.sequence_parallel
    fp8 = software.saved_input_bytes
    # the inputs torch's tensor parallel keeps gathered: float8 in the blocks' fp8 products, the head's
    # (kept in bf16 by torchtitan's float8 conversion) an activation's bytes
    gathered = (1 if software.dtype == "fp8" else a) if software.tp_gathered_inputs else 0
    head_gathered = a if software.tp_gathered_inputs else 0
    per_layer = activations.layer_bytes(model, config.recompute, a, fused, tp, sp, fp8, gathered)
    held_all, held_last, held_layers = held  # held_layers None: a chunk's most blocks a micro-batch
    if held_layers is None or len({len(cuts[s]) for s in stages}) == 1:
        held_layers = held_all * max(len(cuts[s]) for s in stages)
    kept = held_layers * per_layer * tokens
    if last:
        kept += held_last * activations.head_bytes(model, a, fused, tp, sp, head_gathered) * tokens
    rebuild = {
        "none": 0.0,
        "selective-attention": model.q_dim / tp * a,  # one attention core's output, rebuilt
    }.get(config.recompute, activations.layer_bytes(model, "none", a, fused, tp, sp, fp8, gathered))
    head = activations.head_backward_bytes(model, a, tp) if last else 0.0
    messages = 2.0 * _message(model, config, software)
    exchange = context_parallel.working_bytes(model, config, job, software)  # a layer's backward's, with
    working = max(rebuild * tokens + exchange, head * tokens) + messages * tokens  # its rebuilt forward
    if not (walk and walks(config, software)):
        return GpuMemory(weights, gradients, optimizer, kept, working)
    head_kept = activations.head_bytes(model, a, fused, tp, sp, head_gathered) * tokens
    most = stage_buffers.most_held(
        schedule_table(config.schedule, config.pp, config.microbatches, config.chunks)[rank], stages,
        last_stage, config.microbatches,
        {s: len(cuts[s]) * per_layer * tokens + (head_kept if s == last_stage else 0.0) for s in stages},
        model.vocab / tp * a * tokens, messages / 2 * tokens,
        functools.partial(_gradients, model, config, software, cuts),
        late_gradients=config.zero == 3,
    )  # fmt: skip
    working += most.receives - messages * tokens  # the stages' buffers in place of the next two
    return GpuMemory(weights, most.gradients, optimizer, most.activations + most.outputs, working)


def _message(model: PaperModel, config: Config, software: Software) -> float:
    """Bytes a token of one activation (or its gradient) between two stages takes (split under sp)."""
    return model.hidden * software.activation_bytes / (config.tp if config.sequence_parallel else 1)


def _gradients(model, config, software, cuts, stages) -> float:
    """The gradients of ``stages`` on one GPU (none: nothing)."""
    if not stages:
        return 0.0
    parameters, layers, dense = _parameters(model, config, cuts, stages)
    return experts.split_states(_states, model, config, software, parameters, layers, layers - dense)[1]


def walks(config: Config, software: Software) -> bool:
    """Whether a rank's memory is walked along its actions (`stage_buffers`): torch's stages, a pipeline."""
    return software.pipelining == "torch-2024" and config.pp > 1


def _fp8_copies(model: PaperModel, config: Config, software: Software, layers: int, dense: int) -> float:
    """Transformer Engine's fp8 casts of the block matrices a GPU holds (gathered: under ZeRO-3 on one
    stage, the two blocks it holds at once), beside their bf16 copies; the embedding and the head,
    which no fp8 product reads, have none."""
    copy = software.fp8_weight_copy_bytes
    if not copy:
        return 0.0
    if config.zero == 3 and config.pp == 1:
        layers, dense = min(2, layers), min(dense, 2)
    moved = experts.moved_per_layer(model, config)
    matrices = (layers - dense) * (layer_parameters_per_gpu(model, config.tp) - moved)
    if dense:
        matrices += dense * layer_parameters_per_gpu(model.dense_twin(), config.tp)
    norms = layers * 2 * model.norm_parameters()
    return copy * (matrices - norms)


def _root_parameters(model: PaperModel, tp: int) -> float:
    """The embedding's and the head's parameters on one tp rank (a tied matrix once)."""
    return (model.embedding_parameters() + untied_head_parameters(model)) / tp


def untied_head_parameters(model: PaperModel) -> float:
    """The head's parameters beside the embedding's: without the matrix it shares with it when tied."""
    return model.head_parameters() - (model.vocab * model.hidden if model.tied else 0)


def layer_parameters_per_gpu(model: PaperModel, tp: int) -> float:
    """A block's parameters on one tp rank: its matrices split tp ways, its norms whole."""
    norms = 2 * model.norm_parameters()
    return (model.layer_parameters() - norms) / tp + norms


def _states(model, config, software, parameters: float, layers: int) -> tuple[float, float, float]:
    """Weights, gradients and optimizer state of ``parameters`` (``layers`` blocks) on one GPU.

    The weights are what the products read (a bf16 copy; fp32: the weights themselves); the optimizer
    state is Adam's two moments plus, in mixed precision, the fp32 master weights, so that ZeRO-1
    shards the masters with the moments, as Megatron-LM's distributed optimizer and FSDP do. Under a
    pipeline, ZeRO-3 keeps the rank's weights gathered and its gradients whole through the step's
    micro-batches (torch's pipelining turns resharding and gradient sync off until the last one)."""
    dp, zero = config.replicas, config.zero  # the dp x cp ranks that hold the same weights
    mixed = software.dtype != "fp32"
    compute = 2 if mixed else MASTER_BYTES
    state = ADAM_BYTES + (MASTER_BYTES if mixed else 0)
    if zero == 3 and config.pp == 1:  # the layer being run and the next one are gathered
        weights = min(2, layers) * layer_parameters_per_gpu(model, config.tp) * compute
        weights += parameters * compute / dp if not mixed else 0.0  # fp32: the shard is the weights
    else:
        weights = parameters * compute
    sharded_gradients = zero == 2 or (zero == 3 and config.pp == 1)
    gradients = parameters * GRADIENT_BYTES / (dp if sharded_gradients else 1)
    if mixed and zero < 3:  # the bf16 gradients a framework keeps beside its fp32 ones, whole
        gradients += parameters * (GRADIENTS[software.gradients] - GRADIENT_BYTES)
    optimizer = parameters * state / (dp if zero >= 1 else 1)
    return weights, gradients, optimizer


def fits(memory: GpuMemory, capacity: int) -> bool:
    return memory.total <= capacity


def static_floor(model: PaperModel, config: Config, software: Software) -> float:
    """A lower bound of the fullest rank's memory: the whole model's states spread evenly over the
    pipeline and tensor ranks, sharded as far as the ZeRO stage goes (a cheap first test)."""
    parameters = experts.parameters_per_pipeline(model, config) / (config.pp * config.tp)
    return sum(_states(model, config, software, parameters, 0))
