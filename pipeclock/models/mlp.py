"""The course's first subject: a deep MLP cut into pipeline stages.

The course's point is the memory wall: a model too large for one device. So a rank builds *only* its
stage's layers (``ShardedMLP``), never the full model. For the pieces to add up to the one-device model,
layer i's initial weights depend only on (seed, i): the layers a stage builds equal the same layers of
the one-stage model, whatever the number of stages.

Rank r's chunk c is virtual stage ``c * num_stages + r`` (see ``pipeclock.engine.actions``), so with
``chunks > 1`` each rank holds several non-adjacent slices of the model.

Tensor parallel (``tp_plan``) splits the layers in pairs, the Megatron way: the first of a pair by
columns (each rank computes a slice of its outputs, and the ReLU on its slice), the second by rows (each
rank multiplies its slice, and one all-reduce sums them), so a pair costs one collective forward and one
backward. Pairs never straddle a stage: a stage's output is then whole on every tp rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipeclock.models.partition import partition
from pipeclock.models.split import PlacementLike, check_stage, resolve_placement, virtual_stages


class ShardedMLP(nn.Module):
    """Stage ``stage`` of ``num_stages`` of an MLP of ``num_layers`` Linear(hidden, hidden) layers.

    Every layer but the model's last is followed by a ReLU. Only this stage's layers are built; they are
    stored under their global index (``layers.7.weight``) so names agree across any split.
    """

    def __init__(
        self,
        hidden: int,
        num_layers: int = 16,
        stage: int = 0,
        num_stages: int = 1,
        seed: int = 0,
        cut: Sequence[range] | None = None,
    ):
        """``cut`` gives every stage's layers (a cut by cost); by default, `partition`'s by count."""
        super().__init__()
        check_stage(stage, num_stages)
        self.hidden, self.num_layers, self.stage, self.num_stages = hidden, num_layers, stage, num_stages
        self.layer_indices = (cut or partition(num_layers, num_stages))[stage]
        self.layers = nn.ModuleDict({str(i): _seeded_linear(hidden, seed, i) for i in self.layer_indices})

    @classmethod
    def for_rank(
        cls,
        hidden: int,
        num_layers: int,
        rank: int,
        num_stages: int,
        chunks: int = 1,
        seed: int = 0,
        placement: PlacementLike = None,
        cut: Sequence[range] | None = None,
    ) -> list[ShardedMLP]:
        """Rank ``rank``'s chunks as a list, in virtual-stage order (the loop placement unless given)."""
        resolved = resolve_placement(placement, num_stages, chunks)
        stages = virtual_stages(rank, num_stages, chunks, resolved)
        return [cls(hidden, num_layers, v, resolved.num_virtual, seed, cut) for v in stages]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in self.layers.items():
            x = layer(x)
            if int(index) < self.num_layers - 1:
                x = F.relu(x)
        return x

    def extra_repr(self) -> str:
        layers = self.layer_indices
        return f"stage={self.stage}/{self.num_stages}, layers={layers.start}..{layers.stop - 1}"


def tp_plan(hidden: int, stages: Sequence[range], tp: int) -> dict[str, str]:
    """The MLP's tensor-parallel plan for a model cut into ``stages`` (each stage's layer indices): within
    each stage, layers paired from its first, column then row; an odd last layer stays whole.

    Raises ``ValueError`` when ``tp`` does not divide the width (every split layer cuts it).
    """
    if hidden % tp:
        raise ValueError(f"--tp {tp} does not divide the MLP's width {hidden} (--hidden)")
    plan = {}
    for layers in stages:
        for first in range(layers.start, layers.stop - 1, 2):
            plan[f"layers.{first}"], plan[f"layers.{first + 1}"] = "colwise", "rowwise"
    return plan


def _seeded_linear(hidden: int, seed: int, index: int) -> nn.Linear:
    """Layer ``index``'s Linear, initialised from (seed, index) alone (He init for the ReLUs)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    layer = nn.Linear(hidden, hidden, device="meta")
    bound = math.sqrt(6.0 / hidden)
    weight = (torch.rand(hidden, hidden, generator=generator) * 2 - 1) * bound
    layer.weight = nn.Parameter(weight)
    layer.bias = nn.Parameter(torch.zeros(hidden))
    return layer


def full_mlp(hidden: int, num_layers: int = 16, seed: int = 0) -> nn.Sequential:
    """The one-device reference as a plain ``nn.Sequential`` (Linear, ReLU, ..., Linear).

    Its Linear layers equal ``ShardedMLP``'s layer for layer; labs and tests compare against it.
    """
    modules: list[nn.Module] = []
    for index in range(num_layers):
        modules.append(_seeded_linear(hidden, seed, index))
        if index < num_layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes taken by ``module``'s parameters."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
