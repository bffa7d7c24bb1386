"""What travels between stages: a tensor, or a tuple, list or dict of them (a pytree).

A transformer block hands the next one its hidden states and often more: positions for rotary
embeddings, an attention mask, token ids. pipeclock sends any pytree of tensors: each leaf is one message,
and the structure with every leaf's shape and dtype travels once, in a header, the first time a stage
sends a micro-batch of a given size (``encode_header`` / ``decode_header``).

Gradients flow back for the floating-point leaves, and only for them: an integer leaf (positions, ids, a
boolean mask) travels forward only. A floating leaf that the receiving stage does not use gets a zero
gradient, so both sides always agree on which messages a backward sends.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

# torch 2.13 has no public pytree module (torch.utils.pytree is not there yet): this one is torch's own.
import torch.utils._pytree as pytree

HEADER_BYTES = 4096  # one header per (stage, micro-batch size): the structure and every leaf's shape
MAX_LEAVES = 16

Tree = Any  # a tensor, or a tuple / list / dict of trees


def leaves(tree: Tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):  # the common case, several times per action: skip the walk
        return [tree]
    return pytree.tree_leaves(tree)


def tree_map(fn: Callable[[torch.Tensor], Any], tree: Tree) -> Tree:
    return pytree.tree_map(fn, tree)


def carries_gradient(leaf: torch.Tensor) -> bool:
    """Floating-point leaves have gradients; integer and boolean ones travel forward only."""
    return leaf.is_floating_point() or leaf.is_complex()


def gradient_leaves(tree: Tree) -> list[torch.Tensor]:
    """The leaves of ``tree`` whose gradients travel back, in leaf order."""
    return [leaf for leaf in leaves(tree) if carries_gradient(leaf)]


def check_tensors(tree: Tree, what: str) -> None:
    """Every leaf must be a tensor: a stage may not send numbers, strings or None to the next one."""
    flat = pytree.tree_leaves(tree)
    bad = [type(leaf).__name__ for leaf in flat if not isinstance(leaf, torch.Tensor)]
    if bad or not flat:
        found = f"leaves of type {', '.join(sorted(set(bad)))}" if bad else "no tensor at all"
        raise TypeError(f"{what} must be a tensor or a tuple, list or dict of tensors; found {found}")
    if len(flat) > MAX_LEAVES:
        raise TypeError(f"{what} has {len(flat)} tensors; at most {MAX_LEAVES} can travel between stages")


def describe(tree: Tree) -> str:
    """``tuple(float32[4, 8, 16], int64[4, 8])``: the structure and each leaf's dtype and shape."""
    if isinstance(tree, torch.Tensor):
        return f"{str(tree.dtype).removeprefix('torch.')}{list(tree.shape)}"
    if isinstance(tree, dict):
        return "dict(" + ", ".join(f"{key}={describe(value)}" for key, value in tree.items()) + ")"
    if isinstance(tree, list | tuple):
        return f"{type(tree).__name__}(" + ", ".join(describe(item) for item in tree) + ")"
    return type(tree).__name__


# --- batches: cutting every leaf along the batch dimension -------------------------------------------


def batch_size(tree: Tree, what: str) -> int:
    """The size of dimension 0, which every leaf must share."""
    found = leaves(tree)
    strangers = sorted({type(leaf).__name__ for leaf in found if not isinstance(leaf, torch.Tensor)})
    if strangers or not found:
        held = f"holds a {', a '.join(strangers)}" if strangers else "holds no tensor"
        raise ValueError(f"{what} must be a tensor, or a tuple, list or dict of tensors; it {held}")
    sizes = {leaf.shape[0] if leaf.dim() else 0 for leaf in found}
    if len(sizes) != 1:
        raise ValueError(f"the leaves of {what} disagree on the batch size (dimension 0): {describe(tree)}")
    return sizes.pop()


def shape_key(tree: Tree) -> int:
    """A number in [0, 2**32) that changes with the structure, a dtype or a shape past dimension 0.

    The inputs' key travels with the batch size: a step whose key differs from the last one's sends
    new headers, so a sequence length that changes between steps is read with its own shapes.
    """
    flat, spec = pytree.tree_flatten(tree)
    return zlib.crc32(repr((spec, [(leaf.dtype, tuple(leaf.shape[1:])) for leaf in flat])).encode())


def checksum(tree: Tree) -> int:
    """A CRC-32 in [0, 2**32) of ``tree``: its structure, and each leaf's dtype, shape and bytes, in order.

    Two batches that differ anywhere, a sample or the order of two samples, have different checksums
    (but for a chance of one in 2**32). A leaf on a GPU is copied to the host for it.
    """
    flat, spec = pytree.tree_flatten(tree)
    value = zlib.crc32(repr(spec).encode())
    for leaf in flat:
        if not isinstance(leaf, torch.Tensor):
            value = zlib.crc32(repr(leaf).encode(), value)
            continue
        value = zlib.crc32(repr((leaf.dtype, tuple(leaf.shape))).encode(), value)
        data = leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        value = zlib.crc32(data.numpy(), value)
    return value


def split(tree: Tree, sizes: Sequence[int], device: torch.device) -> list[Tree]:
    """``tree`` cut into micro-batches of ``sizes`` samples along dimension 0 of every leaf."""
    flat, spec = pytree.tree_flatten(tree)
    pieces = [torch.split(leaf.to(device), list(sizes)) for leaf in flat]
    return [pytree.tree_unflatten([piece[i] for piece in pieces], spec) for i in range(len(sizes))]


# --- headers: the structure and shapes, once ---------------------------------------------------------


def encode_header(tree: Tree, device: torch.device) -> torch.Tensor:
    """A fixed-size uint8 tensor describing ``tree``: its structure and each leaf's shape and dtype."""
    flat, spec = pytree.tree_flatten(tree)
    text = json.dumps(
        {
            "spec": pytree.treespec_dumps(spec),
            "leaves": [[str(leaf.dtype).removeprefix("torch."), list(leaf.shape)] for leaf in flat],
        }
    ).encode()
    if len(text) > HEADER_BYTES:
        raise TypeError(f"the structure {describe(tree)} is too large to describe in {HEADER_BYTES} bytes")
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    header[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return header.to(device)


Layout = tuple[pytree.TreeSpec, list[tuple[tuple[int, ...], torch.dtype]]]


def decode_header(header: torch.Tensor) -> Layout:
    """The inverse of ``encode_header``: the tree's structure and every leaf's (shape, dtype)."""
    raw = bytes(header.cpu().tolist()).rstrip(b"\0")
    content = json.loads(raw.decode())
    shapes = [(tuple(shape), getattr(torch, dtype)) for dtype, shape in content["leaves"]]
    return pytree.treespec_loads(content["spec"]), shapes


def unflatten(flat: list[torch.Tensor], spec: pytree.TreeSpec) -> Tree:
    return pytree.tree_unflatten(flat, spec)
