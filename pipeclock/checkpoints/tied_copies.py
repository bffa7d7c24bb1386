"""A tied weight held twice on one rank is saved once, and its second copy is restored from the first.

A V places the first and the last stage on one rank, so a tied embedding and head meet there. Without
data parallelism they are one tensor; with it each chunk is its own FSDP2 or DDP unit and owns a copy
(``pipeclock.parallel.replicas``). The copies hold equal values, receive the same summed gradient and so
carry equal optimizer state, but a checkpoint names each weight once (``save_load.GlobalView``), and
torch's state-dict helpers require a name for every parameter the optimizer holds. So while a checkpoint
is saved or loaded the optimizer is shown the first copy alone; after a load the others are set from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from pipeclock.engine.ties import tie_key


def second_copies(modules: Sequence[nn.Module]) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(first copy, other copy) for each tied weight held by more than one tensor on this rank, the
    first being the one ``GlobalView`` names (met first, chunk by chunk)."""
    first: dict[str, nn.Parameter] = {}
    pairs = []
    for module in modules:
        for parameter in module.parameters():
            key = tie_key(parameter)
            if key is None:
                continue
            kept = first.setdefault(key, parameter)
            if kept is not parameter and all(other is not parameter for _, other in pairs):
                pairs.append((kept, parameter))
    return pairs


@contextlib.contextmanager
def first_copies_only(
    modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer
) -> Iterator[list[tuple[nn.Parameter, nn.Parameter]]]:
    """The optimizer without the second copies of tied weights (in its groups and its state) meanwhile;
    yields (first, other) pairs."""
    pairs = second_copies(modules)
    hidden = {id(other) for _, other in pairs}
    groups = [group["params"] for group in optimizer.param_groups]
    states = {id(other): optimizer.state.pop(other) for _, other in pairs if other in optimizer.state}
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in hidden]
        yield pairs
    finally:
        for group, params in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = params
        for _, other in pairs:
            if id(other) in states:
                optimizer.state[other] = states[id(other)]


@torch.no_grad()
def restore_second_copies(
    pairs: Sequence[tuple[nn.Parameter, nn.Parameter]], optimizer: torch.optim.Optimizer
) -> None:
    """Each other copy takes its first copy's value and optimizer state, as after a step they are equal."""
    for kept, other in pairs:
        other.copy_(kept)
        state = optimizer.state.get(kept)
        if state is not None:
            optimizer.state[other] = {
                name: value.clone() if isinstance(value, torch.Tensor) else value
                for name, value in state.items()
            }
