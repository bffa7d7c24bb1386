"""The planner's CUDA memory: what the caching allocator holds beyond the tensors, counted on the CPU.

The rules are PyTorch's (``plan.cuda_memory``): 512-byte blocks, and cuBLAS's workspaces per handle. How
close the planner comes to a GPU run's peak is measured by ``benchmarks/gpu_checks.sh`` on a GPU.
"""

from __future__ import annotations

import dataclasses
import os

from pipeclock.engine.generators import generate
from pipeclock.models.partition import partition
from pipeclock.plan.cuda_memory import MIB, cublas_workspace, rounded, workspaces
from pipeclock.plan.model_specs import mlp_spec
from pipeclock.plan.profile import profile
from pipeclock.plan.rank_memory import rank_memory


def test_a_block_is_a_whole_number_of_512_byte_units():
    assert [rounded(n) for n in (0, 1, 4, 511, 512, 513, 3 * 512 + 1)] == [0, 512, 512, 512, 512, 1024, 2048]


def test_the_cublas_workspace_is_32_mib_on_hopper_8_elsewhere_or_what_the_variable_says():
    assert cublas_workspace((9, 0), {}) == 32 * MIB
    assert cublas_workspace((8, 0), {}) == 8 * MIB + 128 * 1024  # :4096:2:16:8
    assert cublas_workspace((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MIB
    assert cublas_workspace((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert workspaces((9, 0), {}) == 2 * (32 + 1) * MIB  # the forward's and autograd's handles, Lt's too


def test_layers_measured_on_a_gpu_add_the_workspaces_and_every_copy_s_rounding_to_each_rank():
    """Measured on the CPU, then marked as a GPU's: each rank's total grows by the workspaces once and by
    its parameters' rounding once per copy (weights, gradients, Adam's two moments), nothing else."""
    layers = profile(mlp_spec(8, 4), 4, repeats=1, warmup=0)
    on_gpu = [dataclasses.replace(layer, cuda_capability=(9, 0), parameter_slack=96) for layer in layers]
    cut, table = partition(4, 2), generate("1f1b", 2, 4)
    for cpu, gpu in zip(rank_memory(layers, cut, table), rank_memory(on_gpu, cut, table), strict=True):
        assert gpu.total - cpu.total == workspaces((9, 0), os.environ) + 4 * 2 * 96  # 2 layers, 4 copies
        assert gpu.activations == cpu.activations
