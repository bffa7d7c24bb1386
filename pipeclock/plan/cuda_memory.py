"""What a rank holds on a GPU beyond its tensors' own bytes, by the rules of PyTorch's CUDA caching allocator.

``torch.cuda.max_memory_allocated`` (the peak a run reports) counts blocks, not tensors:

- every block is a whole number of 512-byte units, so a tensor of 4 bytes takes 512 (``rounded``);
- cuBLAS keeps a workspace per (handle, stream), allocated through the caching allocator at the first
  matrix product and held for the process's life: ``CUBLAS_WORKSPACE_CONFIG``'s size (``:SIZE_KIB:COUNT``
  pairs), by default 32 MiB on Hopper (compute capability 9.0) and 4096 KiB x 2 + 16 KiB x 8 before, plus
  cuBLASLt's own (``CUBLASLT_WORKSPACE_SIZE`` KiB, 1024 by default). A training step uses two handles:
  the forward runs on the rank's own thread and autograd's backward on its device thread.

The profile (``plan.profile``) measures a layer's temporaries with the same counter, after the
workspaces exist, so they are counted here once per rank (``workspaces``), and its tensors' sizes are
rounded as the allocator rounds them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

BLOCK = 512  # the allocator's smallest unit: every block is a multiple of it
MIB = 2**20
THREADS = 2  # the forward's thread and autograd's: one cuBLAS handle, and workspace, each


def rounded(nbytes: int) -> int:
    """The bytes a block for ``nbytes`` takes: a whole number of 512-byte units (none for nothing)."""
    return -(-nbytes // BLOCK) * BLOCK


def cublas_workspace(capability: tuple[int, int], env: Mapping[str, str]) -> int:
    """One cuBLAS handle's workspace on a device of ``capability``, as ``env`` configures it."""
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 32 * MIB if capability == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublaslt_workspace(env: Mapping[str, str]) -> int:
    """cuBLASLt's workspace of one handle (its own pool unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1)."""
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "1":
        return 0
    value = env.get("CUBLASLT_WORKSPACE_SIZE", "1024")
    return (int(value) if value.isdigit() else 1024) * 1024


def workspaces(capability: tuple[int, int], env: Mapping[str, str]) -> int:
    """What the caching allocator holds on a rank for cuBLAS, whatever the model: every handle's pools."""
    return THREADS * (cublas_workspace(capability, env) + cublaslt_workspace(env))
