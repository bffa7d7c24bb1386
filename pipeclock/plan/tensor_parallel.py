"""Tensor parallel in the measured planner: each measured layer split over the tp ranks of its stage, and
its collectives charged on the link.

Tensor parallel splits a layer's matrices column-wise then row-wise, so each of the tp ranks computes
1/tp of every product and keeps 1/tp of what the layer saves inside itself; the tensors at the layer's
boundary (its input, its output, the message to the next stage) stay whole on every rank, unless
sequence parallel splits them over the tokens. Its parameters, and with them gradients and optimizer
state, divide by tp (a norm's weight is kept whole on every rank: a rounding error beside the matrices).

The collectives, each of the layer's output activation (its ``message_bytes``): a transformer block
all-reduces twice in its forward (after attention, after the MLP) and twice in its backward, the four
all-reduces per layer; with sequence parallel, an all-gather before and a reduce-scatter after each half,
the same bytes in twice as many calls. An MLP's Linear pair (column, then row) all-reduces once each
way, so half a collective per Linear; the embedding and the head once each way. An all-reduce over tp
ranks moves ``2 (tp - 1) / tp`` of the bytes over each rank's link; nothing overlaps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeclock.observe.simulate import Link
from pipeclock.plan.layer_cost import LayerCost

# collectives per layer, each way, by the kind of layer a model's spec names
TRANSFORMER = {"embed": 1.0, "block": 2.0, "layer": 2.0, "head": 1.0}
MLP = {"layer": 0.5, "last": 0.5}
INSIDE = ("held", "weight_held", "weight_extra", "weight_held_checkpointed", "workspace", "unmetered")


@dataclass(frozen=True)
class TensorSplit:
    """``plan --tp``: the degree, each kind of layer's collectives (`TRANSFORMER` or `MLP`), and whether
    sequence parallel splits the activations between layers."""

    tp: int = 1
    collectives: dict | None = None
    sequence_parallel: bool = False

    def describe(self, charged: bool) -> str:
        """The line the planner prints about it (``charged``: the model's times are seconds)."""
        calls = "all-gathers and reduce-scatters" if self.sequence_parallel else "all-reduces"
        how = "charged on the --link-* link, unhidden" if charged else (
            "not charged: a rough model's times are layer forwards, not seconds (measure one with --model)"
        )  # fmt: skip
        return (
            f"tensor parallel {self.tp}: each stage's layers split over {self.tp} ranks, each holding "
            f"1/{self.tp} of their matrices; their {calls} {how}"
        )


def all_reduce_seconds(size: float, tp: int, link: Link, sequence_parallel: bool = False) -> float:
    """One all-reduce of ``size`` bytes among ``tp`` ranks (or, with sequence parallel, an all-gather and
    a reduce-scatter of the same bytes: two calls)."""
    if tp == 1:
        return 0.0
    moved = 2 * (tp - 1) / tp * size / link.bandwidth if link.bandwidth else 0.0
    return moved + (2 if sequence_parallel else 1) * link.latency


def rank_share(count: int, tp: int) -> int:
    """What one of ``tp`` ranks holds of ``count`` numbers of a split layer (parameters, a tied matrix):
    ``count / tp`` rounded up. A norm's weight or a row split's bias is in fact whole on every rank, so
    for a whole model this is a floor, a few vectors short."""
    return -(-count // tp)


def split_layers(
    layers: Sequence[LayerCost],
    tp: int,
    collectives: dict[str, float],
    link: Link = Link(),
    sequence_parallel: bool = False,
) -> list[LayerCost]:
    """``layers`` as one of ``tp`` ranks holds and runs them (the module's rules); ``collectives`` gives
    each kind of layer's collectives each way (`TRANSFORMER`, `MLP`)."""
    if tp == 1:
        return list(layers)
    return [_split(layer, tp, collectives.get(layer.kind, 0.0), link, sequence_parallel) for layer in layers]


def _split(layer: LayerCost, tp: int, calls: float, link: Link, sequence_parallel: bool) -> LayerCost:
    inside = {name: round(value / tp) for name in INSIDE if (value := getattr(layer, name)) is not None}
    if sequence_parallel:
        for name in ("keeps_input", "keeps_output", "input_bytes", "output_bytes", "message_bytes"):
            inside[name] = round(getattr(layer, name) / tp)
    checkpointed = layer.checkpointed and tuple(round(x / tp) for x in layer.checkpointed)
    collective = calls * all_reduce_seconds(layer.message_bytes, tp, link, sequence_parallel)
    return replace(
        layer,
        parameters=rank_share(layer.parameters, tp),
        largest_parameter=rank_share(layer.largest_parameter, tp),
        tied=tuple((key, rank_share(numbers, tp)) for key, numbers in layer.tied),
        checkpointed=checkpointed,
        forward=layer.forward / tp + collective,
        backward=layer.backward / tp + collective,
        input_grad=layer.input_grad / tp + collective,
        weight_grad=layer.weight_grad / tp,
        **inside,
    )
