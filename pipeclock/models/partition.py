"""Cutting a model's layers into stages: contiguous ranges, balanced by count or by cost. Plain
arithmetic, in a module without torch: the planner cuts models it never builds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise


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
