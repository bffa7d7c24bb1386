"""Cutting a model into stages: balanced contiguous ranges of layers, and slices of an ``nn.Sequential``.

Which virtual stages a rank holds is the schedule's placement (``pipeclock.engine.placement``): by
default the loop, where rank r's chunk c is virtual stage ``c * num_stages + r``, so with ``chunks > 1``
each rank holds several non-adjacent slices of the model; ``placement="v"`` gives rank r stages r and
2 * num_stages - 1 - r.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise

from torch import nn

from pipeclock.engine.placement import Placement
from pipeclock.engine.ties import tie, tie_key


def partition(num_layers: int, num_stages: int) -> list[range]:
    """Split ``num_layers`` into ``num_stages`` contiguous ranges whose sizes differ by at most one.

    The earlier stages get the extra layers: the last stage also computes the loss.
    """
    if num_stages < 1:
        raise ValueError(f"the number of stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage needs at least one "
            "layer (use fewer stages or chunks, or more layers)"
        )
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(start, stop) for start, stop in pairwise(bounds)]


def check_stage(stage: int, num_stages: int) -> None:
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is out of range for {num_stages} stages (0..{num_stages - 1})")


PlacementLike = Placement | str | None


def resolve_placement(placement: PlacementLike, num_stages: int, chunks: int) -> Placement:
    """A ``Placement`` from one, from its name (``"loop"``, ``"v"``), or the loop when None."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if isinstance(placement, Placement):
        return placement
    resolved = Placement.named(placement or "loop", num_stages, chunks)
    if resolved.chunks != chunks:
        raise ValueError(f"the {placement} placement gives every rank {resolved.chunks} chunks, not {chunks}")
    return resolved


def virtual_stages(stage: int, num_stages: int, chunks: int, placement: PlacementLike = None) -> list[int]:
    """Rank ``stage``'s virtual stages, in increasing order (its chunks 0, 1, ...)."""
    check_stage(stage, num_stages)
    return list(resolve_placement(placement, num_stages, chunks).stages[stage])


def split_sequential(
    seq: nn.Sequential, stage: int, num_stages: int, chunks: int = 1, placement: PlacementLike = None
) -> nn.Sequential | list[nn.Sequential]:
    """This rank's slice of ``seq``: an ``nn.Sequential`` for one chunk, a list of them for several.

    The slices keep ``seq``'s own module names (``"7"`` stays ``"7"``), so parameter names are the full
    model's: a checkpoint written by any split loads into any other. A Parameter that two slices share
    is tied (``engine.ties``): its copies' gradients are summed, as one device's. ``placement`` (``"v"``, or a
    schedule's ``Placement``) says which slices are this rank's.
    """
    resolved = resolve_placement(placement, num_stages, chunks)
    ranges = partition(len(seq), resolved.num_virtual)
    _tie_shared(seq, ranges)
    slices = [
        seq[ranges[v].start : ranges[v].stop] for v in virtual_stages(stage, num_stages, chunks, resolved)
    ]
    return slices[0] if len(slices) == 1 else slices


def _tie_shared(seq: nn.Sequential, ranges: list[range]) -> None:
    """A Parameter used by two slices (an embedding and a head sharing one matrix) is declared a tie
    under its first name, so that the copies on different ranks get the summed gradient of one device."""
    first_name = {id(p): name for name, p in seq.named_parameters()}
    where: dict[int, set[int]] = {}
    for stage, layers in enumerate(ranges):
        for index in layers:
            for parameter in seq[index].parameters():
                where.setdefault(id(parameter), set()).add(stage)
    for parameter in seq.parameters():
        if len(where.get(id(parameter), ())) > 1 and tie_key(parameter) is None:
            tie(parameter, first_name[id(parameter)])


def partition_by_cost(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous ranges of layers whose largest total cost is as small as it can be.

    ``costs[i]`` is layer i's cost (its measured time, or the bytes it holds). The slowest stage sets
    the pace of a pipeline, so the cut minimises the largest stage; among the cuts that reach that
    minimum it takes the most even one (the smallest sum of squared stage costs), and among equally even
    ones the one whose earlier stages are longer. So equal costs give exactly `partition`.
    """
    prefix = [0.0, *accumulate(costs)]
    return cut_by_stage_cost(
        len(costs), num_stages, lambda _, layers: prefix[layers.stop] - prefix[layers.start]
    )


def cut_by_stage_cost(
    num_layers: int, num_stages: int, stage_cost: Callable[[int, range], float]
) -> list[range]:
    """The contiguous cut minimising the largest ``stage_cost(stage, layers)`` (ties as in
    `partition_by_cost`); a stage-dependent cost lets a stage that holds more micro-batches take less.

    Costs are compared after rounding to nine significant digits of the largest single-layer stage, so
    timings that differ only in their last bits (the same layer measured twice) tie exactly.
    """
    partition(num_layers, num_stages)  # the same errors for impossible sizes
    scale = max(abs(stage_cost(s, range(i, i + 1))) for s in range(num_stages) for i in range(num_layers))
    quantum = (scale or 1.0) * 1e-9

    def cost(stage: int, start: int, stop: int) -> int:
        return round(stage_cost(stage, range(start, stop)) / quantum)

    # best[(stage, start)]: the best key for stages stage.. covering layers start..; key = (largest stage,
    # sum of squares, negated sizes: longer earlier stages compare smaller), and the sizes themselves.
    best: dict[tuple[int, int], tuple[int, int, tuple[int, ...]]] = {}
    last = num_stages - 1
    for start in range(last, num_layers):
        c = cost(last, start, num_layers)
        best[(last, start)] = (c, c * c, (-(num_layers - start),))
    for stage in range(last - 1, -1, -1):
        for start in range(stage, num_layers - (last - stage)):
            options = []
            for stop in range(start + 1, num_layers - (last - stage) + 1):
                c = cost(stage, start, stop)
                rest_max, rest_squares, rest_sizes = best[(stage + 1, stop)]
                options.append((max(c, rest_max), c * c + rest_squares, (-(stop - start), *rest_sizes)))
            best[(stage, start)] = min(options)
    sizes = [-size for size in best[(0, 0)][2]]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [range(start, stop) for start, stop in pairwise(bounds)]
