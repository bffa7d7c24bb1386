"""Cutting a model into stages: slices of an ``nn.Sequential`` over the ranges `partition` gives.

Which virtual stages a rank holds is the schedule's placement (``pipeclock.engine.placement``): by
default the loop, where rank r's chunk c is virtual stage ``c * num_stages + r``, so with ``chunks > 1``
each rank holds several non-adjacent slices of the model; ``placement="v"`` gives rank r stages r and
2 * num_stages - 1 - r.
"""

from __future__ import annotations

from torch import nn

from pipeclock.engine.placement import Placement
from pipeclock.engine.ties import tie, tie_key
from pipeclock.models.partition import partition


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
