"""One rank's memory in training, before running it: what it holds per parameter, and what its
micro-batches hold along its own order of actions.

A rank's memory during training is, per parameter it holds, its weight, its gradient and the
optimizer's state (all fp32), plus the activations its micro-batches hold at the schedule's peak, plus
the buffers its next messages land in, plus the running action's working memory. The first part depends
only on the cut; the activations depend on the cut and on the order of the rank's own actions
(``ActivationMeter``'s rule: a micro-batch's bytes are held from the end of its F to the end of its last
backward, and a split backward's I keeps only what W needs), so the peak is read off the schedule itself,
no timing needed.

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
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pipeclock.engine.actions import Action, Schedule, join_first_stage_backwards, placement_of
from pipeclock.plan import cuda_memory
from pipeclock.plan.layer_cost import LayerCost

FP32_BYTES = 4  # a weight, and its gradient, in fp32
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "momentum": 4, "sgd": 0}  # per parameter, fp32
# Temporaries of one parameter tensor's update, in copies of it: Adam's denominator, sqrt then divided.
OPTIMIZER_TEMPORARIES = {"adam": 2, "adamw": 2, "momentum": 0, "sgd": 0}
ACTIVATION_SCALE = {"fp32": 1.0, "bf16": 0.5}
# Per parameter, the copy of the weights the forwards compute with: autocast casts each weight to bf16 once
# per step and keeps it for the step's micro-batches (measured: 17 MiB for the MLP rank's 8.4M parameters).
COMPUTE_COPY_BYTES = {"fp32": 0, "bf16": 2}


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
    weight_work = sum(_weight_held(x, c) for x, c in zip(layers, checkpointed, strict=True))
    # while the graph stays until W, a layer's kept inputs are already the forward's (unless checkpointed)
    beyond = sum(
        _weight_held(x, c) if c or x.weight_extra is None else x.weight_extra
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


def _weight_held(layer: LayerCost, checkpointed: bool) -> int:
    """What W keeps for the layer between I and W, checkpointed or not (as measured).

    Checkpointed, a layer keeps at least what it keeps without: the profile checkpoints a layer alone,
    and the model's first layer is then rebuilt only in W (nothing before it wants a gradient), while in
    a stage checkpointed whole it is rebuilt in I with the others and keeps its input for W as usual.
    """
    if checkpointed and layer.weight_held_checkpointed is not None:
        return max(layer.weight_held_checkpointed, layer.weight_held)
    return layer.weight_held


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


@dataclass(frozen=True)
class RankMemory:
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # as the activation meter counts them
    messages: int
    workspace: int = 0  # temporaries of one action, and what the meter does not see (the loss's ...)
    optimizer_step: int = 0  # the optimizer's temporaries, after the pipeline step (activations freed)
    runtime: int = 0  # what the engine itself holds whatever the model: given, measured on a tiny one

    @property
    def total(self) -> int:
        static = self.parameters + self.gradients + self.optimizer + self.runtime
        return static + max(self.activations + self.messages + self.workspace, self.optimizer_step)

    @property
    def parts(self) -> dict[str, int]:
        parts = {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "messages": self.messages,
            "workspace": self.workspace,
        }
        return parts | ({"runtime": self.runtime} if self.runtime else {})


def rank_memory(
    layers: Sequence[LayerCost],
    cut: Sequence[range],
    table: Schedule,
    training: Training = Training(),
    runtime: int = 0,
) -> list[RankMemory]:
    """Each rank's memory for ``table`` (a schedule with its placement) on the model cut by ``cut``;
    ``runtime`` is what the engine holds on each rank whatever the model (its Python objects, the
    communication library's buffers, the allocator's own), given or measured with a tiny model. Layers
    measured on a GPU add what the CUDA caching allocator holds beyond the tensors (``cuda_memory``):
    cuBLAS's workspaces, and the rounding of every parameter, gradient and optimizer state."""
    capability = layers[0].cuda_capability
    runtime += cuda_memory.workspaces(capability, os.environ) if capability else 0
    states = OPTIMIZER_STATE_BYTES[training.optimizer] // FP32_BYTES  # Adam: its two moments
    placement = placement_of(table)
    table = join_first_stage_backwards(table)  # as the engine runs it
    stages = [stage_bytes([layers[i] for i in part], training) for part in cut]
    scale = activation_scale(layers, training)
    result = []
    for rank, actions in enumerate(table):
        virtual = placement.stages[rank]
        held_layers = [i for s in virtual for i in cut[s]]
        parameters = held_parameters([layers[i] for i in held_layers])
        keeps_graph = any(_keeps_graph(layers, cut[s], training.recompute) for s in virtual)
        peak = activation_peak(actions, [stages[s] for s in virtual], keeps_graph)
        messages = max(_message_bytes(layers, cut, s, scale) for s in virtual)
        chunks = [stages[s] for s in virtual]
        workspace = working_peak(actions, chunks, keeps_graph) - peak
        largest = max(layers[i].largest_parameter for i in held_layers)
        slack = sum(layers[i].parameter_slack for i in held_layers)  # one copy's rounding, on a GPU
        copy = 1 if COMPUTE_COPY_BYTES[training.dtype] else 0
        result.append(
            RankMemory(
                parameters=(FP32_BYTES + COMPUTE_COPY_BYTES[training.dtype]) * parameters
                + slack * (1 + copy),
                gradients=FP32_BYTES * parameters + slack,
                optimizer=OPTIMIZER_STATE_BYTES[training.optimizer] * parameters + slack * states,
                activations=peak,
                messages=messages,
                workspace=workspace,
                optimizer_step=OPTIMIZER_TEMPORARIES[training.optimizer] * largest,
                runtime=runtime,
            )
        )
    return result


def held_parameters(layers: Sequence[LayerCost]) -> int:
    """The parameters of ``layers`` held together: a tensor tied between two of them (a GPT's embedding
    and head on one rank) is one tensor there, counted once."""
    total, seen = sum(layer.parameters for layer in layers), set()
    for layer in layers:
        for key, numbers in layer.tied:
            total -= numbers if key in seen else 0
            seen.add(key)
    return total


def _keeps_graph(layers: Sequence[LayerCost], part: range, recompute: Recompute) -> bool:
    """Whether W goes back through the forward's graph on this stage: a module with parameters that is
    not a Linear does, outside a checkpoint (inside, W runs it again on the input its rebuild saw)."""
    if recompute.full:
        return False
    return any(layers[i].keeps_graph and not recompute.checkpointed(n) for n, i in enumerate(part))


def activation_peak(actions: Sequence[Action], chunks: Sequence[StageBytes], keeps_graph: bool = True) -> int:
    """The most activation bytes one rank holds while it works through ``actions`` in order.

    ``chunks[c]`` is what its chunk c holds per micro-batch. A split backward's I swaps the forward's
    bytes for what W needs, or, when W goes back through the graph (``keeps_graph``), keeps them and adds
    what W needs beyond them (a Linear's input is both, and counted once, as the meter counts it).
    A recomputed span's rebuild is the backward's working memory, not counted here (nor by the meter).
    """
    return max(_activations_after(actions, chunks, keeps_graph), default=0)


def _activations_after(
    actions: Sequence[Action], chunks: Sequence[StageBytes], keeps_graph: bool
) -> Iterator[int]:
    """The activation bytes held after each of ``actions`` (``activation_peak``'s rules)."""
    held: dict[tuple[int, int], int] = {}
    live = 0
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
        yield live


def unmetered_peak(actions: Sequence[Action], chunks: Sequence[StageBytes], keeps_graph: bool = True) -> int:
    """The most bytes held outside the meter's count: the loss's, from each F to its backward, and the
    storages the meter misses, until the backward is done (a split I frees them unless W needs the
    graph)."""
    return max(_unmetered_after(actions, chunks, keeps_graph), default=0)


def _unmetered_after(
    actions: Sequence[Action], chunks: Sequence[StageBytes], keeps_graph: bool
) -> Iterator[int]:
    live = 0
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
        yield live


def working_peak(actions: Sequence[Action], chunks: Sequence[StageBytes], keeps_graph: bool = True) -> int:
    """The most one rank holds beyond its weights while it works: activations (the meter's and what it
    misses) plus the running action's working memory, action by action.

    An F's temporaries come on top of what it has just saved; a backward's (its temporaries, and a
    recomputed segment's rebuild) on top of what was held before it. Before a split I, the micro-batch
    holds its forward only: what W needs comes out of the rebuild, so the two are not added up.
    """
    metered = _activations_after(actions, chunks, keeps_graph)
    unmetered = _unmetered_after(actions, chunks, keeps_graph)
    peak, before = 0, 0
    for action, activations, missed in zip(actions, metered, unmetered, strict=True):
        chunk, after = chunks[action.chunk], activations + missed
        if action.op == "F":
            peak = max(peak, after + chunk.workspace)
        else:
            extra = chunk.backward_extra if action.op in ("B", "I") else 0
            peak = max(peak, before + chunk.workspace + extra, after)
        before = after
    return peak


def _message_bytes(layers: Sequence[LayerCost], cut: Sequence[range], stage: int, scale: float) -> int:
    """The receive buffers a stage keeps posted: the next activation in, and the next gradient in."""
    part = cut[stage]
    incoming = layers[part.start - 1].message_bytes if part.start > 0 else 0
    gradient = layers[part.stop - 1].output_bytes if stage < len(cut) - 1 else 0
    return round((incoming + gradient) * scale)
