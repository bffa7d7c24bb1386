"""Whether a tensor-parallel plan keeps each tensor whole where it is read whole, seen as a stage first runs.

torch's styles hand each split module's output on as a local tensor: a column split's (``colwise``) is
this rank's slice of it, a row split's is whole again (its partial sums added). So, module by module in
the order they run, a stage is either *whole* or *open*: opened by a column split, closed by the row split
that reads the slices. A plan is refused, naming the first module where the layouts disagree, when

- a row split that expects slices runs while the stage is whole (col/row swapped, only ``out`` split);
- a module with weights of its own that the plan does not split runs while the stage is open (a ``v``
  left whole beside a split ``q`` and ``k``, a Linear after a lone column split): it would read slices,
  or hand on a whole tensor where its neighbours hand on slices;
- the stage ends open: its output (sent on at a cut, or read by the loss) would be each rank's slice;
- a replicated module (``replicate``, ``replicated_with_grad_allreduce``) runs while open with a weight
  that does not fit the trailing dims of its input (Cohere's per-head norm ``[heads, head_dim]`` over a
  rank's share of the heads).

A replicated module that runs while open and fits (Qwen3's ``q_norm`` over each head) works on this
rank's slice alone: its gradient is this rank's part of the whole, so it is summed over the tp group
(what ``transformers``' ``replicated_with_grad_allreduce`` means), as one of torch's functional
collectives (DTensor's partial-to-replicate), each time autograd produces it. Dropout drawn while open
is `tp_dropout`'s.

The check runs in the stage's first forward in training mode, a pre-hook before each module, so a bad
plan stops before any module reads a tensor laid out wrong (never a shape error from inside torch); the
hooks are gone once that forward ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from pipeclock import comms
from pipeclock.engine.rng import KeyedDropout
from pipeclock.engine.step_run import StageError
from pipeclock.parallel import tp_dropout
from pipeclock.parallel.tp_dropout import Region

OPENING = ("colwise",)  # a column split whose output stays sliced
READING_SLICES = ("rowwise",)  # a row split whose input is this rank's slice
READING_WHOLE = ("rowwise_split_input", "rowwise_rep")  # a row split that slices a whole input itself
REPLICATED = ("replicate", "replicated_with_grad_allreduce")


class PlanRefused(StageError, ValueError):
    """A plan refused in a stage's first forward: a refusal (one line, exit 2) that the pipeline passes on
    as it is, as it does a stage's own error."""


@dataclass
class Watch:
    """One chunk's check, armed until its first forward in training mode has run."""

    source: str
    styles: dict[int, tuple[str, str]]  # id(module) -> (name, style)
    mesh: DeviceMesh
    region: Region = field(default_factory=Region)
    active: bool = False
    handles: list = field(default_factory=list)
    mode: tp_dropout.SlicedDropout | None = None


def watch(chunk: nn.Module, styles: dict[int, tuple[str, str]], mesh: DeviceMesh, source: str) -> None:
    """Arm the check on ``chunk``; ``styles`` maps each module the plan names to its (name, style)."""
    found = Watch(source, styles, mesh)
    found.handles.append(chunk.register_forward_pre_hook(lambda module, args: _start(found, module)))
    found.handles.append(
        chunk.register_forward_hook(lambda module, args, out: _finish(found, module), always_call=True)
    )
    for name, module in chunk.named_modules():
        if name and _watched(module, id(module) in styles):
            found.handles.append(
                module.register_forward_pre_hook(
                    lambda m, args, name=name: _before(found, name, m, args), prepend=True
                )
            )
    for module in chunk.modules():
        if styles.get(id(module), (None, None))[1] in REPLICATED:
            module.register_forward_pre_hook(_summing_hook(mesh))


def _watched(module: nn.Module, planned: bool) -> bool:
    own = next(module.parameters(recurse=False), None) is not None
    return planned or own or isinstance(module, KeyedDropout | nn.Dropout)


def _start(found: Watch, chunk: nn.Module) -> None:
    found.active, found.mode = True, None
    found.region.open.clear()
    if chunk.training:
        found.mode = tp_dropout.SlicedDropout(found.region, found.mesh, found.source)
        found.mode.__enter__()


def _finish(found: Watch, chunk: nn.Module) -> None:
    if not found.active:
        return
    found.active = False
    trained = found.mode is not None
    if trained:
        found.mode.__exit__(None, None, None)
    if found.region.open:
        name, module = found.region.open[-1]
        found.region.open.clear()
        style = found.styles[id(module)][1]
        raise PlanRefused(
            f"rank {comms.get_rank()}: {found.source} leaves the stage's output split: {name} ({style}) "
            "hands on each rank's slice and no row split after it makes it whole; a stage's output "
            "(sent on, or read by the loss) must be whole (end with a rowwise module, or use "
            "colwise_gather_output)"
        )
    if not trained:
        return  # checked again in the next forward, until one in training mode has run
    for handle in found.handles:
        handle.remove()
    if found.mode.used:
        tp_dropout.keep_slicing(chunk, found.styles, found.mesh, found.source)


def _refuse(found: Watch, message: str) -> None:
    """Stop watching this forward (the chunk's end hook stays quiet) and refuse in one line."""
    found.active = False
    found.region.open.clear()
    if found.mode is not None:
        found.mode.__exit__(None, None, None)
    raise PlanRefused(f"rank {comms.get_rank()}: {found.source}: {message}")


def _before(found: Watch, name: str, module: nn.Module, args) -> None:
    if not found.active:
        return
    region, planned = found.region, found.styles.get(id(module))
    style = planned[1] if planned else None
    if isinstance(module, KeyedDropout | nn.Dropout):
        if region.open and module.p > 0 and module.training:
            _refuse(
                found,
                f"{name} (dropout {module.p}) runs on each rank's slice of "
                f"{region.open[-1][0]}'s output, which tp cannot draw as one process does: "
                "set that dropout to 0 or train without --tp",
            )
        return
    if style not in OPENING and _holds_a_column_split(module, found.styles):
        _own_weights_beside_a_split(found, name, module, style)
    if style in OPENING:
        region.open.append((name, module))
    elif style in READING_SLICES:
        if not region.open:
            _refuse(
                found,
                f"{name} (rowwise) expects each rank's slice of its input, but nothing "
                "before it in the stage splits one (a colwise module must come first)",
            )
        region.open.clear()
    elif style == "per_head":
        return  # split with the heads it reads
    elif style in READING_WHOLE:
        _refuse_if_open(found, name, style)
    elif style in REPLICATED:
        if region.open:
            _fits_a_slice(found, name, module, args)
            module._pipeclock_tp_sum = True
    elif style is None:
        if region.open and not isinstance(module, nn.Linear | nn.Embedding):
            _fits_a_slice(found, name, module, args)
        _refuse_if_open(found, name, None)
    elif style is not None and region.open:
        _refuse_if_open(found, name, style)


def _own_weights_beside_a_split(found: Watch, name: str, module: nn.Module, style: str | None) -> None:
    """A module that runs a column split and holds weights of its own (DiffLlama's ``lambda_q1``, a
    sink per head) may use them on each rank's slice: summed like a replicated module's if the plan
    marks it so, else refused."""
    own = [n for n, _ in module.named_parameters(recurse=False)]
    if not own:
        return
    if style in REPLICATED:
        module._pipeclock_tp_sum = True
        return
    _refuse(
        found,
        f"{name} holds weights of its own ({', '.join(own)}) beside the column split it runs, where they "
        "may meet each rank's slice: mark it replicated_with_grad_allreduce if they work on each slice "
        "alone (their gradients are then summed over tp), or split it otherwise",
    )


def _refuse_if_open(found: Watch, name: str, style: str | None) -> None:
    if not found.region.open:
        return
    opener, module = found.region.open[-1]
    what = f"({style}) takes a whole input" if style else "is whole on every rank"
    _refuse(
        found,
        f"{name} {what} but runs after {opener} ({found.styles[id(module)][1]}), "
        "whose output is each rank's slice until a rowwise module: split it with them, or mark it "
        "replicated_with_grad_allreduce if it works on each slice alone",
    )


def _fits_a_slice(found: Watch, name: str, module: nn.Module, args) -> None:
    """A replicated module fed a slice must work on it alone: each of its weights broadcasts over the
    input's trailing dims (a dim of 1, or the input's own size)."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    for parameter in module.parameters(recurse=False):
        shape = tuple(parameter.shape)
        trailing = None if x is None else tuple(x.shape[len(x.shape) - len(shape) :])
        if (
            trailing is None
            or len(trailing) != len(shape)
            or any(p not in (1, t) for p, t in zip(shape, trailing, strict=True))
        ):
            got = "?" if x is None else list(x.shape)
            _refuse(
                found,
                f"{name} is whole on every rank but runs on each rank's slice of "
                f"{found.region.open[-1][0]}'s output ({got}), which its weight {list(shape)} does not "
                "fit (a weight per head, where tp splits the heads): pipeclock does not split it; "
                "train without --tp",
            )


def _holds_a_column_split(module: nn.Module, styles: dict[int, tuple[str, str]]) -> bool:
    return any(styles.get(id(m), (None, None))[1] in OPENING for m in module.modules() if m is not module)


def _summing_hook(mesh: DeviceMesh):
    """A pre-hook that, once the check found ``module`` fed a slice, hooks each of its parameters (the
    current ones: a replica may have swapped them) to have their gradients summed over the tp group."""
    hooked: dict[str, int] = {}

    def hook(module: nn.Module, args) -> None:
        if not getattr(module, "_pipeclock_tp_sum", False) or not torch.is_grad_enabled():
            return
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.requires_grad and hooked.get(name) != id(parameter):
                parameter.register_hook(lambda grad: summed(grad, mesh))
                hooked[name] = id(parameter)

    return hook


def summed(grad: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Each tp rank's part of one gradient, summed (DTensor's partial made replicate: one all-reduce)."""
    return DTensor.from_local(grad, mesh, [Partial()], run_check=False).full_tensor()
