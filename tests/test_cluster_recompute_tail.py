"""A full recompute under torch's non-reentrant checkpoint (torchtitan's) stops at the last tensor the
backward reads: measured here, the block's last product does not run again; the planner leaves it and
its collective out of the recompute where the run says so (``Software.recompute_stops_early``), and
charges the whole forward again otherwise (Megatron-LM's, DeepSpeed's)."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_time import Rates, _gemm_seconds, _tp_collective, layer_time
from pipeclock.plan.gpus import KINDS
from pipeclock.plan.paper_model import PaperModel

LLAMA = PaperModel("test Llama", layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=2816,
                   vocab=32000, norm="rms", gated=True)  # fmt: skip


class _Products(TorchDispatchMode):
    """Counts the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _backward_products(checkpointed: bool, compiled: bool = False) -> int:
    torch.manual_seed(0)
    up, down = torch.randn(8, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(x @ up) @ down

    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)

    x = torch.randn(4, 8, requires_grad=True)
    out = (torch.compile(run, backend="aot_eager", fullgraph=True) if compiled else run)(x)
    with _Products() as products:
        out.sum().backward()
    return products.count


def test_non_reentrant_checkpoint_reruns_every_product_but_the_last():
    # the backward's own two products per product (input and weight gradients), plus the first product
    # run again: the last one's output feeds only the block's output, which the backward never reads
    assert _backward_products(checkpointed=False) == 4
    assert _backward_products(checkpointed=True) == 4 + 1
    assert _backward_products(checkpointed=True, compiled=True) == 4 + 1  # torch.compile's, as torchtitan's


def _layer(software: Software, sequence_parallel: bool):
    config = Config(tp=8, pp=1, dp=1, schedule="1f1b", chunks=1, microbatch_size=2, microbatches=1,
                    recompute="full", zero=0, sequence_parallel=sequence_parallel)  # fmt: skip
    job = Job(2, 4096)
    rates = Rates(KINDS["H100-80GB"], software)
    down = LLAMA.gemms()[-1]
    tokens = 2 * 4096
    last = _gemm_seconds(down, tokens, LLAMA, 8, rates.a, rates)
    half = _tp_collective(LLAMA, config, tokens, software, rates)
    return layer_time(LLAMA, config, job, software, rates), last, half


def test_a_recompute_that_stops_early_leaves_out_the_down_projection_and_its_collective():
    assert LLAMA.gemms()[-1].role == "down"
    for dtype, gathered in (("bf16", 2.0), ("fp8", 1.0)):  # torchao gathers float8: one byte to two
        whole = Software(dtype, True)
        layer, _, _ = _layer(whole, sequence_parallel=True)
        assert layer.recompute == layer.forward  # Megatron-LM's, DeepSpeed's: the whole forward again
        early = dataclasses.replace(whole, recompute_stops_early=True)
        layer, last, half = _layer(early, sequence_parallel=True)
        reduce_scatter = half * 2.0 / (2.0 + gathered)
        assert abs(layer.recompute - (layer.forward - last - reduce_scatter)) <= 1e-12
        layer, last, half = _layer(early, sequence_parallel=False)  # the whole all-reduce
        assert abs(layer.recompute - (layer.forward - last - half)) <= 1e-12
