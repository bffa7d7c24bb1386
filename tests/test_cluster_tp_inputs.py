"""What a column-parallel product keeps under sequence parallel: torch's ``ColwiseParallel`` keeps its input
gathered over the sequence (measured here on two gloo ranks), which the planner counts where the run
says so (``Software.tp_gathered_inputs``), for the blocks, their rebuild under full recompute, and the
head; Megatron-LM's way (the shard kept, gathered again in the backward) stays the default."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeclock.plan.activations import head_bytes, layer_bytes
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import gpu_memory
from pipeclock.plan.paper_model import PaperModel
from tests.distributed import run_ok

LLAMA = PaperModel("test Llama", layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=2816,
                   vocab=32000, norm="rms", gated=True)  # fmt: skip
BATCH, SEQ, HIDDEN, OUT = 2, 16, 32, 24


def _saved_by_colwise(rank: int, world_size: int) -> tuple[int, int]:
    """(bytes autograd saves for a ColwiseParallel Linear fed a sequence shard, bytes of the input
    gathered over the sequence) on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    linear = torch.nn.Linear(HIDDEN, OUT, bias=False)
    parallelize_module(linear, mesh, ColwiseParallel(input_layouts=Shard(1)))
    shard = torch.randn(BATCH, SEQ // world_size, HIDDEN, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in (p.to_local().untyped_storage().data_ptr() for p in linear.parameters()):
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        linear(shard).sum().backward()
    return sum(saved.values()), BATCH * SEQ * HIDDEN * shard.element_size()


def test_torchs_column_parallel_product_keeps_its_input_gathered_over_the_sequence():
    for kept, gathered in run_ok(_saved_by_colwise, 2):
        assert kept == gathered  # the whole sequence's input, not the rank's half of it


def test_gathered_inputs_add_the_attentions_and_the_mlps_whole_inputs_to_a_layer_and_one_to_the_head():
    h, a = LLAMA.hidden, 2
    for recompute in ("none", "selective-attention"):
        plain = layer_bytes(LLAMA, recompute, a, True, tp=4, sp=True)
        for gathered in (1, 2):  # float8, bf16
            kept = layer_bytes(LLAMA, recompute, a, True, 4, True, gathered=gathered)
            assert kept == plain + 2 * h * gathered
    assert head_bytes(LLAMA, a, True, 4, True, gathered=2) == head_bytes(LLAMA, a, True, 4, True) + h * 2
    for tp, sp in ((1, False), (4, False), (1, True)):  # nothing is gathered over the sequence
        kept = layer_bytes(LLAMA, "none", a, True, tp, sp, gathered=2)
        assert kept == layer_bytes(LLAMA, "none", a, True, tp, sp)
        assert head_bytes(LLAMA, a, True, tp, sp, 2) == head_bytes(LLAMA, a, True, tp, sp)
    kept = layer_bytes(LLAMA, "full", a, True, 4, True, gathered=2)
    assert kept == layer_bytes(LLAMA, "full", a, True, 4, True)


@pytest.mark.parametrize("dtype, vocab, rebuilt", [("fp8", 32000, 0), ("fp8", 1024, 1), ("bf16", 1024, 2)])
def test_under_full_recompute_the_head_keeps_its_input_gathered_and_a_rebuilt_layer_both_of_its_own(
    dtype, vocab, rebuilt
):
    """The head's input is kept from its forward to its backward, in bf16; the layer rebuilt in the
    backward keeps its two gathered inputs (float8 ones under fp8: torchao gathers them cast), which
    count where the rebuild, not the head's backward, is the larger (``rebuilt``: their bytes an element,
    0 where the head's backward is the larger)."""
    model = dataclasses.replace(LLAMA, vocab=vocab)
    job, tokens, h = Job(8, 2048), 2 * 2048, LLAMA.hidden
    config = Config(4, 1, 2, "1f1b", 1, 2, 2, "full", 3, True)
    before = gpu_memory(model, config, job, Software(dtype, True))
    after = gpu_memory(model, config, job, Software(dtype, True, tp_gathered_inputs=True))
    assert after.activations - before.activations == h * 2 * tokens
    assert after.working - before.working == 2 * h * rebuilt * tokens


def test_torchtitans_tensor_parallel_rows_are_predicted_within_10_percent_of_their_published_memory():
    """Tables 4 to 6 (70B on 256 GPUs, 405B on 512), but Table 5's 1F1B row, whose published peak is
    10 GiB over the interleaved row's where the planner holds the same on their fullest ranks
    (docs/cluster.md: not explained); the context-parallel rows are held in their own test file."""
    from benchmarks.cluster_check import errors, predict
    from benchmarks.published_2024 import titan_rows

    split = [
        row
        for row in titan_rows()
        if row.fixed["tp"] > 1
        and row.fixed.get("cp", 1) == 1
        and (row.source, row.name) != ("torchtitan T5", "1F1B")
    ]
    assert len(split) == 4
    for row in split:
        row.predicted = predict(row)
        memory = errors(row)[1]
        assert abs(memory) <= 0.10, f"{row.source} {row.name}: {memory:+.1%}"
