"""ZeRO-3 without a pipeline, as FSDP2 runs it: where a micro-batch's gathers and reduce-scatters fall,
and how much of them its compute hides.

FSDP2 (``torch.distributed.fsdp.fully_shard``, one unit per block as torchtitan applies it) all-gathers a
block's parameters before its forward and, resharded after the forward (the default), again before its
backward; it reduce-scatters the block's gradients after its backward. It runs them on streams of their
own and prefetches one block ahead: the next block's gather starts as this block's compute starts, so the
first gather of a pass waits for nothing and hides behind nothing, and each later one hides only behind
the compute of the block before it (torch's FSDP notes, "FSDP Prefetch Nuances"). Each micro-batch of a
step repeats all of it: gradient accumulation under FSDP2 reduce-scatters every micro-batch's gradients
unless the run turns gradient sync off, which this module does not model. The collectives share the
data-parallel link, one after another in the order they are issued; a pass ends when its compute and its
last collective are both done (the optimizer needs the gradients).

A unit is a block, the first also carrying the embedding and the last the head and loss. The embedding
and the head belong to the root module, which FSDP2 does not reshard after the forward ("we usually set
False for the root module, because the root module is typically required immediately when the backward
pass begins": ``fully_shard``'s docs), and torchtitan keeps the last block unsharded too: the forward
gathers the root with the first block, the backward gathers neither the root nor the last block again,
and the root's gradients are reduce-scattered last, once its embedding's backward is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """One FSDP unit for one micro-batch on one GPU, in seconds: its forward and its backward compute
    (recompute included), its parameters' all-gather before the forward and again before the backward,
    and its gradients' reduce-scatter."""

    forward: float
    backward: float
    gather: float
    reduce: float
    regather: float | None = None  # None: the same as ``gather``

    @property
    def backward_gather(self) -> float:
        return self.gather if self.regather is None else self.regather


def forward_exposed(units: Sequence[Unit]) -> float:
    """Seconds the forward pass over ``units`` (in order) waits for gathers, beyond its compute."""
    return pass_exposed(units, backward=False)


def backward_exposed(units: Sequence[Unit]) -> float:
    """Seconds the backward pass over ``units`` (taken last to first) waits for gathers and for its
    reduce-scatters to finish, beyond its compute."""
    return pass_exposed(units, backward=True)


def pass_exposed(units: Sequence[Unit], backward: bool) -> float:
    """Seconds one pass over ``units`` waits on the link beyond its compute. The two passes differ in three
    things: the backward takes the units last to first, gathers ``backward_gather`` (the forward
    ``gather``), and queues each unit's reduce-scatter once its backward is done."""
    order = list(reversed(units)) if backward else list(units)
    gathers = [unit.backward_gather if backward else unit.gather for unit in order]
    computes = [unit.backward if backward else unit.forward for unit in order]
    link = gathers[0]  # the first gather: nothing to hide behind
    ready, clock = link, 0.0
    for index, compute in enumerate(computes):
        start = max(clock, ready)
        if index + 1 < len(order):  # prefetch the next unit as this one starts
            link = max(link, start) + gathers[index + 1]
            ready = link
        clock = start + compute
        if backward:  # its gradients leave once its backward is done
            link = max(link, clock) + order[index].reduce
    return max(clock, link) - sum(computes)


def microbatch_exposed(units: Sequence[Unit]) -> float:
    """One micro-batch's exposed communication: its forward's and its backward's."""
    return forward_exposed(units) + backward_exposed(units)


def units(layers: int, layer: tuple[float, float], ends: tuple[float, float, float, float],
          parameters: tuple[float, float, float], per_parameter: tuple[float, float],
          latency: float) -> list[Unit]:  # fmt: skip
    """The units of a one-stage model of ``layers`` blocks (the module's rules): ``layer`` is a block's
    (forward, backward) seconds, ``ends`` the embedding's (forward, backward) then the head's,
    ``parameters`` the parameters a GPU gathers for the embedding, for a block and for the head; a
    parameter's gather and reduce-scatter cost ``per_parameter`` seconds, and each collective ``latency``
    more."""
    first_f, first_b, last_f, last_b = ends
    embedding, block, head = parameters
    gather_each, reduce_each = per_parameter
    result = []
    for index in range(layers):
        forward, backward, held, again = layer[0], layer[1], block, block
        if index == 0:  # the root (embedding and head) is gathered with it, and reduced after it
            forward, backward, held = forward + first_f, backward + first_b, held + embedding + head
        if index == layers - 1:  # kept from its forward to its backward, the root with it
            forward, backward, again = forward + last_f, backward + last_b, 0.0
        result.append(Unit(
            forward, backward, held * gather_each + latency, held * reduce_each + latency,
            again * gather_each + (latency if again else 0.0),
        ))  # fmt: skip
    return result
