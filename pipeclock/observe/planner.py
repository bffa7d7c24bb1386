"""Will it fit, and how fast will it go? Per-rank memory and step time of a pipeline, before running it.

A rank's memory during training is, per parameter it holds, its weight, its gradient and the
optimizer's state (all fp32), plus the activations its micro-batches hold at the schedule's peak, plus
the buffers its next messages land in. The first part depends only on the cut; the activations depend
on the cut and on the order of the rank's own actions (``ActivationMeter``'s rule: a micro-batch's bytes
are held from the end of its F to the end of its last backward, and a split backward's I keeps only
what W needs), so the peak is read off the schedule itself, no timing needed. The step time is the
simulator's, fed with each stage's own costs.

Everything here is a pure function of the per-layer costs (`LayerCost`, measured by
``pipeclock.observe.profile`` or made up for a model too large to build), so the same numbers come out
on any machine and are easy to check by hand.

Modelled beyond what the engine measures today:

- activation recompute, as the engine applies it to each stage: ``full`` checkpoints the whole stage,
  which then keeps only its input; ``every-K`` checkpoints every K-th layer of the stage, which keeps
  what the profile measured it to keep when checkpointed (its input, for a GPT block). A checkpointed
  span runs its forward again in its backward and holds its activations meanwhile: working memory of
  that backward (the meter leaves it out, the resident memory does not);
- bf16 (autocast): the fp32 master weights, gradients and optimizer state stay as they are, and
  autocast adds a bf16 copy of the weights for the step (counted with the parameters); the
  activations are what a profile under autocast measured (``profile(..., dtype="bf16")``), or half the
  float32 profile's, an estimate (autocast keeps some saved tensors in float32); messages travel in bf16.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeclock.engine.actions import Action, Schedule, placement_of
from pipeclock.engine.generators import chunks_of, generate, get_schedule, supports_chunks
from pipeclock.models.split import cut_by_stage_cost, partition, partition_by_cost
from pipeclock.observe.profile import LayerCost
from pipeclock.observe.simulate import simulate
from pipeclock.observe.timeline import Timeline

FP32_BYTES = 4  # a weight, and its gradient, in fp32
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "momentum": 4, "sgd": 0}  # per parameter, fp32
# Temporaries of one parameter tensor's update, in copies of it: Adam's denominator, sqrt then divided.
OPTIMIZER_TEMPORARIES = {"adam": 2, "adamw": 2, "momentum": 0, "sgd": 0}
ACTIVATION_SCALE = {"fp32": 1.0, "bf16": 0.5}
# Per parameter, the copy of the weights the forwards compute with: autocast casts each weight to bf16 once
# per step and keeps it for the step's micro-batches (measured: 17 MiB for the MLP rank's 8.4M parameters).
COMPUTE_COPY_BYTES = {"fp32": 0, "bf16": 2}
BALANCES = ("layers", "time", "memory")


# --- sizes as people write them -----------------------------------------------------------------------

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"24GB"`` -> 24 * 10**9, ``"24GiB"`` -> 24 * 2**30, ``"512MB"``, ``"1.5TB"``; a unit is required."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size: write a number and a unit, like 24GB or 80GiB")
    number, unit = float(match.group(1)), match.group(2)
    if not unit:
        raise ValueError(f"{text!r} has no unit: write 24GB (10^9 bytes) or 24GiB (2^30 bytes)")
    if unit.upper() not in _UNITS:
        raise ValueError(
            f"unknown unit {unit!r} in {text!r}: use B, KB, MB, GB, TB (powers of 1000) "
            "or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    return round(number * _UNITS[unit.upper()])


def format_bytes(count: float, binary: bool = False, digits: int = 3) -> str:
    """``40 GB`` or ``37.3 GiB``: ``digits`` significant digits at most, in the largest unit below the
    size."""
    steps = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if binary else (
        ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)
    )  # fmt: skip
    for name, size in steps:
        if abs(count) >= size:
            value = count / size
            text = f"{value:.{digits}g}" if value < 1000 else f"{value:.0f}"
            return f"{text} {name}"
    return f"{count:.0f} B"


# --- the options a plan varies ------------------------------------------------------------------------


@dataclass(frozen=True)
class Recompute:
    """``none``, ``full`` (the whole stage one checkpoint), or ``every-K`` (every K-th layer of a stage
    checkpointed alone), as ``pipeclock.engine.recompute`` applies them."""

    every: int = 0  # K of every-K; 0: no layer checkpointed alone
    full: bool = False

    @classmethod
    def parse(cls, text: str) -> Recompute:
        if text == "none":
            return cls()
        if text == "full":
            return cls(full=True)
        match = re.fullmatch(r"every-(\d+)", text)
        if not match or int(match.group(1)) < 1:
            raise ValueError(f"unknown recompute {text!r}: use none, full or every-K (K >= 1)")
        return cls(int(match.group(1)))

    @property
    def enabled(self) -> bool:
        return self.full or self.every > 0

    def checkpointed(self, position: int) -> bool:
        """Whether the layer at ``position`` in its stage is checkpointed alone (every-K)."""
        return self.every > 0 and (position + 1) % self.every == 0

    def __str__(self) -> str:
        return "full" if self.full else f"every-{self.every}" if self.every else "none"


@dataclass(frozen=True)
class Training:
    """What besides the cut and the schedule sets the memory: dtype, optimizer, recompute."""

    dtype: str = "fp32"
    optimizer: str = "adam"
    recompute: Recompute = Recompute()

    def __post_init__(self) -> None:
        if self.dtype not in ACTIVATION_SCALE:
            raise ValueError(f"unknown dtype {self.dtype!r}: use {' or '.join(ACTIVATION_SCALE)}")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"unknown optimizer {self.optimizer!r}: use {', '.join(OPTIMIZER_STATE_BYTES)}")

    @property
    def bytes_per_parameter(self) -> int:
        """Weight + gradient + optimizer state: 16 for fp32 Adam (and for bf16 with fp32 masters)."""
        return 2 * FP32_BYTES + OPTIMIZER_STATE_BYTES[self.optimizer]


# --- one stage's activations --------------------------------------------------------------------------


@dataclass(frozen=True)
class StageBytes:
    """What one virtual stage holds for one micro-batch: after F; what W needs, after a split I; and the
    extra during its backward (a recomputed segment's activations)."""

    forward: int
    weight_work: int
    backward_extra: int
    weight_beyond: int | None = None  # of weight_work, what the forward's graph does not keep (None: all)
    loss: int = 0  # what the loss keeps from F to the backward (the meter does not count it)
    unmetered: int = 0  # what F keeps beyond the meter's count: whole storages behind views, captures
    workspace: int = 0  # the largest temporary any of its layers needs while it runs


def stage_bytes(layers: Sequence[LayerCost], training: Training = Training()) -> StageBytes:
    """A stage of ``layers`` (consecutive), one micro-batch, by the meter's rule: its input and output
    (stashed by the engine), what each layer saves, and each inner boundary once if either side keeps it.
    """
    scale = activation_scale(layers, training)
    recompute = training.recompute
    total = layers[0].input_bytes + layers[-1].output_bytes
    if recompute.full:  # one checkpoint: it keeps the stage's input, already counted
        checkpointed = [True] * len(layers)
        extra = _inner_bytes(layers, [False] * len(layers)) + layers[0].input_bytes
    else:
        checkpointed = [recompute.checkpointed(position) for position in range(len(layers))]
        total += _inner_bytes(layers, checkpointed)
        extra = max(
            (layer.held + layer.input_bytes for layer, c in zip(layers, checkpointed, strict=True) if c),
            default=0,
        )
    weight_work = sum(layer.weight_held for layer in layers)
    # while the graph stays until W, a layer's kept inputs are already the forward's (unless checkpointed)
    beyond = sum(
        x.weight_held if c or x.weight_extra is None else x.weight_extra
        for x, c in zip(layers, checkpointed, strict=True)
    )
    return StageBytes(
        round(total * scale),
        round(weight_work * scale),
        round(extra * scale),
        weight_beyond=round(beyond * scale),
        loss=layers[-1].loss_held,
        # a checkpointed layer's forward keeps nothing, so none of what the meter misses either
        unmetered=round(sum(x.unmetered for x, c in zip(layers, checkpointed, strict=True) if not c) * scale),
        workspace=round(max(layer.workspace for layer in layers) * scale),
    )


def activation_scale(layers: Sequence[LayerCost], training: Training) -> float:
    """How the layers' measured activation bytes become ``training.dtype``'s: 1 when they were measured in
    it (a profile under autocast), else the ratio of the dtypes' sizes (a float32 profile planned for
    bf16: every activation halved, an estimate, since autocast keeps some tensors in float32)."""
    measured = layers[0].dtype
    return ACTIVATION_SCALE[training.dtype] / ACTIVATION_SCALE[measured]


def _inner_bytes(layers: Sequence[LayerCost], checkpointed: Sequence[bool]) -> int:
    """What a run of layers saves inside itself: each layer's own, and each boundary between two layers
    once, when either side keeps it."""
    saves = [layer.saves(c) for layer, c in zip(layers, checkpointed, strict=True)]
    total = sum(held for held, _, _ in saves)
    total += sum(max(a[2], b[1]) for a, b in itertools.pairwise(saves))
    return total


# --- a whole plan: the cut, the memory per rank, the step time ----------------------------------------


@dataclass(frozen=True)
class RankMemory:
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # as the activation meter counts them
    messages: int
    workspace: int = 0  # temporaries of one action, and what the meter does not see (the loss's ...)
    optimizer_step: int = 0  # the optimizer's temporaries, after the pipeline step (activations freed)

    @property
    def total(self) -> int:
        static = self.parameters + self.gradients + self.optimizer
        return static + max(self.activations + self.messages + self.workspace, self.optimizer_step)

    @property
    def parts(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "messages": self.messages,
            "workspace": self.workspace,
        }


@dataclass(frozen=True)
class Plan:
    """One configuration, judged: its cut, each rank's memory, and the simulated step."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    training: Training
    balance: str
    cut: tuple[range, ...]
    memory: tuple[RankMemory, ...]
    step_time: float | None = None  # None until simulated
    bubble: float | None = None

    @property
    def peak(self) -> int:
        return max(rank.total for rank in self.memory)

    def fits(self, device_memory: int) -> bool:
        return self.peak <= device_memory


def cut_for(
    layers: Sequence[LayerCost],
    num_virtual: int,
    balance: str,
    training: Training = Training(),
    table: Schedule | None = None,
) -> list[range]:
    """The model's cut into ``num_virtual`` stages: by layer count, by time (F + B), or by memory.

    By memory, a stage weighs its static bytes (weights, gradients, optimizer state) plus its
    activations times the micro-batches it holds at once under ``table`` (one each without a table):
    1F1B's first stage holds p micro-batches and its last one, so the first gets fewer layers.
    """
    if balance == "layers":
        return partition(len(layers), num_virtual)
    if balance == "time":
        return partition_by_cost([layer.forward + layer.backward for layer in layers], num_virtual)
    if balance == "memory":
        per_parameter = training.bytes_per_parameter
        held = in_flight(table) if table is not None else [1] * num_virtual

        def weight(stage: int, part: range) -> float:
            chosen = [layers[i] for i in part]
            activations = held[stage] * stage_bytes(chosen, training).forward
            return per_parameter * sum(x.parameters for x in chosen) + activations

        return cut_by_stage_cost(len(layers), num_virtual, weight)
    raise ValueError(f"unknown balance {balance!r}: use {', '.join(BALANCES)}")


def in_flight(table: Schedule) -> list[int]:
    """Per virtual stage: the most micro-batches it holds at once (its F done, its backward not)."""
    placement = placement_of(table)
    most = [0] * placement.num_virtual
    for rank, actions in enumerate(table):
        live = [0] * placement.num_virtual
        for action in actions:
            stage = placement.stage(rank, action.chunk)
            if action.op == "F":
                live[stage] += 1
                most[stage] = max(most[stage], live[stage])
            elif action.op in ("B", "W"):
                live[stage] -= 1
    return most


def rank_memory(
    layers: Sequence[LayerCost], cut: Sequence[range], table: Schedule, training: Training = Training()
) -> list[RankMemory]:
    """Each rank's memory for ``table`` (a schedule with its placement) on the model cut by ``cut``."""
    placement = placement_of(table)
    stages = [stage_bytes([layers[i] for i in part], training) for part in cut]
    scale = activation_scale(layers, training)
    result = []
    for rank, actions in enumerate(table):
        virtual = placement.stages[rank]
        held_layers = [i for s in virtual for i in cut[s]]
        parameters = sum(layers[i].parameters for i in held_layers)
        keeps_graph = any(layers[i].keeps_graph for i in held_layers)
        peak = activation_peak(actions, [stages[s] for s in virtual], keeps_graph)
        messages = max(_message_bytes(layers, cut, s, scale) for s in virtual)
        chunks = [stages[s] for s in virtual]
        working = max(chunk.workspace + chunk.backward_extra for chunk in chunks)  # one action at a time
        workspace = working + unmetered_peak(actions, chunks, keeps_graph)
        largest = max(layers[i].largest_parameter for i in held_layers)
        result.append(
            RankMemory(
                parameters=(FP32_BYTES + COMPUTE_COPY_BYTES[training.dtype]) * parameters,
                gradients=FP32_BYTES * parameters,
                optimizer=OPTIMIZER_STATE_BYTES[training.optimizer] * parameters,
                activations=peak,
                messages=messages,
                workspace=workspace,
                optimizer_step=OPTIMIZER_TEMPORARIES[training.optimizer] * largest,
            )
        )
    return result


def activation_peak(actions: Sequence[Action], chunks: Sequence[StageBytes], keeps_graph: bool = True) -> int:
    """The most activation bytes one rank holds while it works through ``actions`` in order.

    ``chunks[c]`` is what its chunk c holds per micro-batch. A split backward's I swaps the forward's
    bytes for what W needs, or, when W goes back through the graph (``keeps_graph``), keeps them and adds
    what W needs beyond them (a Linear's input is both, and counted once, as the meter counts it).
    A recomputed span's rebuild is the backward's working memory, not counted here (nor by the meter).
    """
    held: dict[tuple[int, int], int] = {}
    live = peak = 0
    for action in actions:
        key, chunk = (action.microbatch, action.chunk), chunks[action.chunk]
        if action.op == "F":
            held[key] = chunk.forward
            live += chunk.forward
        elif action.op in ("B", "I"):
            if action.op == "B":
                live -= held.pop(key)
            else:
                beyond = chunk.weight_work if chunk.weight_beyond is None else chunk.weight_beyond
                after = chunk.forward + beyond if keeps_graph else chunk.weight_work
                live += after - held[key]
                held[key] = after
        else:  # W
            live -= held.pop(key)
        peak = max(peak, live)
    return peak


def unmetered_peak(actions: Sequence[Action], chunks: Sequence[StageBytes], keeps_graph: bool = True) -> int:
    """The most bytes held outside the meter's count: the loss's, from each F to its backward, and the
    storages the meter misses, until the backward is done (a split I frees them unless W needs the
    graph)."""
    live = peak = 0
    held: dict[tuple[int, int], int] = {}
    for action in actions:
        key, chunk = (action.microbatch, action.chunk), chunks[action.chunk]
        if action.op == "F":
            held[key] = chunk.unmetered
            live += chunk.loss + chunk.unmetered
        elif action.op == "B":
            live -= chunk.loss + held.pop(key)
        elif action.op == "I":
            live -= chunk.loss + (0 if keeps_graph else held[key])
            held[key] = held[key] if keeps_graph else 0
        else:
            live -= held.pop(key)
        peak = max(peak, live)
    return peak


def _message_bytes(layers: Sequence[LayerCost], cut: Sequence[range], stage: int, scale: float) -> int:
    """The receive buffers a stage keeps posted: the next activation in, and the next gradient in."""
    part = cut[stage]
    incoming = layers[part.start - 1].message_bytes if part.start > 0 else 0
    gradient = layers[part.stop - 1].output_bytes if stage < len(cut) - 1 else 0
    return round((incoming + gradient) * scale)


def step_time(
    layers: Sequence[LayerCost],
    cut: Sequence[range],
    table: Schedule,
    training: Training = Training(),
    comm_latency: float = 0.0,
    action_overhead: float = 0.0,
) -> Timeline:
    """The simulated step (a ``Timeline``): each action costs what its stage's layers cost, plus
    ``action_overhead``, the engine's own time per action (its Python, posting and waiting on
    messages), which no layer profile sees.

    F is the sum of the layers' forwards; B their backwards (I + W where the engine splits them); with
    recompute, a backward first runs the recomputed layers' forwards again.
    """
    placement = placement_of(table)
    per_stage = [_stage_times([layers[i] for i in part], training) for part in cut]

    def cost(rank: int, action: Action) -> float:
        return per_stage[placement.stage(rank, action.chunk)][action.op] + action_overhead

    return simulate(table, cost, comm_latency=comm_latency)


def _stage_times(layers: Sequence[LayerCost], training: Training) -> dict[str, float]:
    recompute = training.recompute
    again = sum(x.forward for i, x in enumerate(layers) if recompute.full or recompute.checkpointed(i))
    return {
        "F": sum(x.forward for x in layers),
        "B": again + sum(x.backward for x in layers),
        "I": again + sum(x.input_grad for x in layers),
        "W": sum(x.weight_grad for x in layers),
    }


def judge(
    layers: Sequence[LayerCost],
    schedule: str,
    stages: int,
    microbatches: int,
    training: Training = Training(),
    balance: str = "layers",
    simulated: bool = True,
    cut: Sequence[range] | None = None,
    action_overhead: float = 0.0,
) -> Plan:
    """One configuration's cut (``balance``'s, unless ``cut`` is given) and memory, and (``simulated``)
    its step time and bubble (each action costing ``action_overhead`` more than its layers)."""
    chunks = chunks_of(schedule) or (2 if supports_chunks(get_schedule(schedule)) else 1)
    table = generate(schedule, stages, microbatches, chunks)
    num_virtual = placement_of(table).num_virtual
    cut = list(cut) if cut is not None else cut_for(layers, num_virtual, balance, training, table)
    memory = rank_memory(layers, cut, table, training)
    plan = Plan(schedule, stages, microbatches, chunks, training, balance, tuple(cut), tuple(memory))
    if not simulated:
        return plan
    timeline = step_time(layers, cut, table, training, action_overhead=action_overhead)
    return replace(plan, step_time=timeline.makespan, bubble=timeline.bubble_share)
