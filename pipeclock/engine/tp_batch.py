"""The tp ranks of a stage take the same batch: one small all-reduce per step, where the batch is read.

Tensor parallel's ranks compute one result together: each holds a part of every split layer, and the
collectives join the parts. Given different inputs (or targets), each rank would join its part of one
batch with the others' parts of another: every gradient wrong, and nothing fails. So before a step the
tp ranks of the first stage compare the inputs they were given, and those of the last stage the
targets, by a CRC-32 of each (``pytree.checksum``): one all-reduce on the tp group of the checksums and
their negations, the maximum of each (all agree when the largest equals the smallest). The stages in
between receive what their tp peers' previous stages computed from that one batch.

The group is the one passed to ``Pipeline`` (``tp_group``), else the ``"tp"`` dim of the mesh the
chunks' split parameters (DTensors) live on, as ``parallel.init_mesh`` names it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeclock import comms
from pipeclock.engine import pytree

ENDS = ("inputs", "targets")


def tp_group_of(chunks: Sequence[nn.Module]) -> dist.ProcessGroup | None:
    """The ``"tp"`` group of the mesh the chunks' split parameters live on; None without one."""
    for chunk in chunks:
        for parameter in chunk.parameters():
            mesh = getattr(parameter, "device_mesh", None)
            if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
                return mesh.get_group("tp")
    return None


class TensorParallelPeers:
    """This rank's tp group, for comparing the batch its ranks were given (nothing without one)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        self.group = group if len(ranks) > 1 else None
        self.ranks, self.device = ranks, device

    def differing(self, given: dict[str, object]) -> list[str]:
        """Which of ``given`` (``"inputs"``, ``"targets"``: what this rank's stage reads) the tp ranks
        of this stage hold differently, the same list on each of them; ``[]`` when they agree.

        Every tp rank of a stage calls it with the same keys (they hold the same stage): a rank that
        could not read its batch passes what it was given all the same.
        """
        if self.group is None or not given:
            return []
        mine = [pytree.checksum(tree) for tree in given.values()]
        both = torch.tensor(mine + [-value for value in mine], dtype=torch.int64, device=self.device)
        reduced = comms.all_reduce(both, "comparing the tp ranks' batches", self.group, op=dist.ReduceOp.MAX)
        largest, smallest = reduced[: len(mine)].tolist(), [-v for v in reduced[len(mine) :].tolist()]
        return [name for name, high, low in zip(given, largest, smallest, strict=True) if high != low]

    def refusal(self, differing: list[str], stage: str) -> str:
        """The line a rank of that stage says, after its rank prefix."""
        ranks = ", ".join(map(str, self.ranks))
        return (
            f"the tp ranks of the {stage} (ranks {ranks}) were given different {' and '.join(differing)}: "
            "tensor parallel computes one result from one batch, so give every one of them the same"
        )
