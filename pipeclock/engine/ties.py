"""Weights tied across stages: one matrix on one device, a copy on each stage that uses it.

GPT-2's token embedding (first stage) and its output head (last stage) are one matrix. Cut into stages,
each end holds a copy. For the update to be one device's, the copies must start equal and receive the same
gradient: the sum of both uses' gradients, which is what the one shared tensor accumulates on one device.

Declare a tie once, where the model is built: ``tie(parameter, key)`` marks a parameter with the name of
the weight it is a copy of (its one-device name, e.g. ``embed.wte.weight``). A ``Pipeline`` finds the
marks on its modules: copies on one rank are summed in memory (or are already the same tensor), copies on
several ranks are summed by one all-reduce over just those ranks. On the first step the copies are made
equal (the lowest rank's copy wins), so a user's own model cannot start them apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipeclock import comms

TIE_ATTRIBUTE = "pipeclock_tie"


def tie(parameter: nn.Parameter, key: str) -> nn.Parameter:
    """Mark ``parameter`` as a copy of the tied weight named ``key``; returns it."""
    setattr(parameter, TIE_ATTRIBUTE, key)
    return parameter


def tie_key(parameter: torch.Tensor) -> str | None:
    return getattr(parameter, TIE_ATTRIBUTE, None)


def tied_parameters(modules: Iterable[nn.Module]) -> dict[str, list[nn.Parameter]]:
    """This rank's copies of each tied weight, each distinct tensor once."""
    found: dict[str, list[nn.Parameter]] = {}
    for module in modules:
        for parameter in module.parameters():
            key = tie_key(parameter)
            if key is not None and all(parameter is not p for p in found.get(key, [])):
                found.setdefault(key, []).append(parameter)
    return found


@dataclass
class _Tie:
    key: str
    copies: list[nn.Parameter]  # this rank's
    ranks: list[int]  # every rank holding a copy
    group: dist.ProcessGroup | None  # None when only this rank holds it


class TiedGradients:
    """Sums the gradients of every tied weight over its copies; every rank of the world creates one,
    together (on its first step).

    ``group`` is the pipeline's process group (default: the world). With data-parallel replicas each
    replica's copies are summed among themselves, over groups that every rank of the world creates.
    """

    def __init__(self, modules: Iterable[nn.Module], group: dist.ProcessGroup | None = None):
        self.local = tied_parameters(modules)
        self.group = group
        self.ties: list[_Tie] | None = None  # found on the first sync: a collective every rank joins

    def _connect(self) -> list[_Tie]:
        """Every rank's (pipeline, place in it, tied keys), gathered over the world, so that every rank
        creates every tie's group, in one order, whatever pipeline it is in (replicas of one, or
        pipelines of other lengths running side by side)."""
        rank, world = comms.get_rank(), comms.get_world_size()
        if self.group is None:
            pipeline, place = tuple(range(world)), rank
        else:
            pipeline, place = tuple(dist.get_process_group_ranks(self.group)), dist.get_rank(self.group)
        everyone = comms.all_gather_object(
            (pipeline, place, sorted(self.local)), "finding the ranks that share tied weights"
        )
        pipelines: dict[tuple[int, ...], dict[int, list[str]]] = {}
        for ranks, where, keys in everyone:
            pipelines.setdefault(tuple(ranks), {})[where] = keys
        ties = []
        for ranks_of, holders in sorted(pipelines.items()):
            for key in sorted({key for keys in holders.values() for key in keys}):
                ranks = [ranks_of[s] for s in sorted(holders) if key in holders[s]]
                group = dist.new_group(ranks) if len(ranks) > 1 else None  # every rank calls new_group
                if rank in ranks:
                    ties.append(_Tie(key, self.local[key], ranks, group))
        for tied in ties:
            self._make_equal(tied)
        return ties

    @staticmethod
    def _make_equal(tied: _Tie) -> None:
        first = _local(tied.copies[0].data)
        with torch.no_grad():
            if tied.group is not None:
                comms.broadcast(first, tied.ranks[0], f"sharing the tied weight {tied.key}", tied.group)
            for copy in tied.copies[1:]:
                _local(copy.data).copy_(first)

    def prepare(self) -> None:
        """Before the first forward: find who holds which tie, and make the copies equal."""
        if self.ties is None:
            self.ties = self._connect()

    def sync(self) -> None:
        """After the backward: every copy's ``.grad`` becomes the sum over all copies (one device's)."""
        self.prepare()
        with torch.no_grad():
            self._sum_copies()

    def _sum_copies(self) -> None:
        for tied in self.ties:
            for copy in tied.copies:
                if copy.grad is None:
                    copy.grad = torch.zeros_like(copy)
            grads = [_local(copy.grad) for copy in tied.copies]
            total = sum(grads[1:], grads[0].clone(memory_format=torch.contiguous_format))  # as gloo needs
            if tied.group is not None:
                comms.all_reduce(total, f"summing the gradients of the tied weight {tied.key}", tied.group)
            for grad in grads:
                grad.copy_(total)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the shard of a data-parallel (FSDP2) DTensor, else the tensor.

    Copies of a tie are sharded alike over the same replicas, so summing shard by shard is summing whole.
    """
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
