"""Dropout between a column split and its row split, drawn as one process draws it.

Between a column split and the row split that reads its slices, a rank holds some of the heads (or
columns): attention probabilities ``[batch, heads / tp, queries, keys]``. ``F.dropout`` there (and the
dropout inside ``F.scaled_dot_product_attention``) would draw a mask of that local shape from the
generator the layer was seeded with (`pipeclock.models.hf.randomness`), the first elements of the one
process's mask rather than this rank's heads of it. Here each rank draws the whole mask, in the order and
shape one process does (``F.dropout`` of ones of the whole shape, what SDPA's math path draws too on the
CPU), and keeps its own heads' slice: the mask, the generator's state after it, the loss and the
gradients are one process's, at the cost of drawing ``tp`` times the numbers.

A dropout there whose split dim cannot be told (not 4-d attention probabilities, nor a last dim that is
the column split's share) is refused in one line, and so is SDPA's dropout on a GPU, drawn inside its
fused kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from pipeclock import comms

OPENING, READING = ("colwise",), ("rowwise", "rowwise_split_input", "rowwise_rep")


@dataclass
class Region:
    """The column splits whose slices are live on this rank (empty: the stage is whole)."""

    open: list[tuple[str, nn.Module]] = field(default_factory=list)


class SlicedDropout(TorchFunctionMode):
    """While ``region.open`` (a column split's slices are live), dropout draws the whole mask and keeps
    this rank's slice; ``used`` says whether any did."""

    def __init__(self, region, mesh: DeviceMesh, source: str):
        super().__init__()
        self.region, self.mesh, self.source, self.used = region, mesh, source, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.region.open and func is F.dropout:
            x, p, training = _dropout_arguments(args, kwargs)
            if training and p > 0:
                return x * self._mask(x, p)
        if self.region.open and func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0) > 0:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _mask(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """This rank's slice of the whole mask (scaled by 1 / (1 - p)): ``F.dropout`` of ones of the whole
        shape, the same draw from the same generator as one process's ``F.dropout`` on any device."""
        self.used = True
        dim = self._split_dim(x)
        tp, rank = self.mesh.size(), self.mesh.get_local_rank()
        whole = list(x.shape)
        whole[dim] *= tp
        mask = F.dropout(torch.ones(whole, dtype=x.dtype, device=x.device), p, training=True)
        return mask.narrow(dim, rank * x.shape[dim], x.shape[dim])

    def _split_dim(self, x: torch.Tensor) -> int:
        if x.dim() == 4:
            return 1  # attention probabilities: [batch, heads, queries, keys]
        name, module = self.region.open[-1]
        if x.shape[-1] * self.mesh.size() == module.weight.shape[0]:
            return x.dim() - 1  # the column split's own output
        raise ValueError(
            f"rank {comms.get_rank()}: {self.source}: a dropout of shape {list(x.shape)} runs on each "
            f"rank's slice of {name}'s output, and pipeclock cannot tell which of its dims tp splits: "
            "set it to 0 or train without --tp"
        )

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):  # fmt: skip
        """SDPA's math, with the dropout of the attention probabilities drawn whole and sliced (the CPU's
        SDPA draws them as ``F.dropout`` does; a GPU's fused kernels draw their own way: refused)."""
        if query.device.type != "cpu":
            raise ValueError(
                f"rank {comms.get_rank()}: {self.source}: attention dropout inside "
                "F.scaled_dot_product_attention on a GPU draws its mask inside the kernel, which tp cannot "
                "slice as one process draws it: set attention_dropout to 0, or use attn_implementation eager"
            )
        if enable_gqa:
            key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
            value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
        scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
        scores = query @ key.transpose(-2, -1) * scale
        if is_causal:
            keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return (probabilities * self._mask(probabilities, dropout_p)) @ value


def _dropout_arguments(args, kwargs) -> list:
    """``F.dropout``'s input, p and training, however they were passed."""
    given = dict(zip(("input", "p", "training"), args, strict=False)) | kwargs
    return [given["input"], given.get("p", 0.5), given.get("training", True)]


def keep_slicing(chunk: nn.Module, styles: dict[int, tuple[str, str]], mesh: DeviceMesh, source: str) -> None:
    """After the first forward found dropout between the splits: from now on, each module that holds a
    column split runs under `SlicedDropout` (its hooks fire again when recompute replays it)."""
    region = Region()
    owners: dict[int, nn.Module] = {}
    for name, module in chunk.named_modules():
        for child_name, child in module.named_children():
            child_style = styles.get(id(child), (None, None))[1]
            if child_style in OPENING:
                owners[id(module)] = module
                where = f"{name}.{child_name}"
                child.register_forward_pre_hook(lambda m, a, n=where: region.open.append((n, m)))
            elif child_style in READING:
                child.register_forward_pre_hook(lambda m, a: region.open.clear())
    for owner in owners.values():
        mode = SlicedDropout(region, mesh, source)
        owner.register_forward_pre_hook(lambda m, a, mode=mode: _enter(mode, region, m))
        owner.register_forward_hook(lambda m, a, o, mode=mode: _leave(mode, region, m), always_call=True)


def _enter(mode: SlicedDropout, region, module: nn.Module) -> None:
    region.open.clear()
    mode.__enter__()


def _leave(mode: SlicedDropout, region, module: nn.Module) -> None:
    mode.__exit__(None, None, None)
    region.open.clear()
