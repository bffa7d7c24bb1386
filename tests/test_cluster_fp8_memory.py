"""What an fp8 run keeps, on paper: Transformer Engine keeps each fp8 product's input as its fp8 cast (one
byte an element) and each weight's fp8 cast with its transpose; torchao keeps bf16 (`FP8_KEEPS`)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeclock.plan.activations import layer_bytes
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import gpu_memory, layer_parameters_per_gpu
from pipeclock.plan.paper_model import PaperModel

LLAMA = PaperModel("llama", 8, 4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=32000)
GPT = PaperModel(
    "gpt", 8, 2048, heads=16, kv_heads=16, head_dim=128, ffn=8192, vocab=32000, gated=False, norm="layer"
)


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["swiglu", "gelu"])
def test_a_te_fp8_layer_keeps_each_products_input_in_one_byte(model):
    """Of what a fused bf16 layer keeps, the products' inputs that are not also another operation's drop
    to one byte: both norms' outputs (the q/k/v and the gate/up products' inputs) and the MLP's last
    hidden values (the down projection's); the attention output stays bf16 for the attention core's
    backward, and the output projection adds its own fp8 copy of it."""
    h, q, ffn = model.hidden, model.q_dim, model.ffn
    bf16 = layer_bytes(model, "none", 2, fused=True)
    fp8 = layer_bytes(model, "none", 2, fused=True, fp8=1)
    assert bf16 - fp8 == 2 * h + ffn - q
    # under tensor and sequence parallel, every one of them is a tp rank's share
    split = layer_bytes(model, "none", 2, fused=True, tp=4, sp=True, fp8=1)
    assert split == pytest.approx(fp8 / 4, rel=0.01)


def test_a_te_fp8_swiglu_layer_counted_tensor_by_tensor():
    """Llama's layer under Megatron-Core's Transformer Engine layers, bytes per token: each norm's bf16
    input and fp8 output; q, k, v and the attention output in bf16 with the fp32 log-sum-exp, and the
    output projection's fp8 copy; the gate's and up's bf16 outputs and their product in fp8."""
    m = LLAMA
    norms = 2 * (2 * m.hidden + 1 * m.hidden)
    attention = 2 * (2 * m.q_dim + 2 * m.kv_dim) + 4 * m.heads + 1 * m.q_dim
    mlp = 2 * 2 * m.ffn + 1 * m.ffn
    assert layer_bytes(m, "none", 2, fused=True, fp8=1) == norms + attention + mlp


def test_recompute_keeps_what_it_kept_and_the_others_scale_with_it():
    assert layer_bytes(LLAMA, "full", 2, fp8=1) == layer_bytes(LLAMA, "full", 2)
    lse = 4 * LLAMA.heads
    assert (
        layer_bytes(LLAMA, "selective-attention", 2, True, fp8=1)
        == layer_bytes(LLAMA, "none", 2, True, fp8=1) - lse
    )


def _memory(fp8: str, **config):
    knobs = dict(tp=2, pp=2, dp=2, schedule="1f1b", chunks=1, microbatch_size=1, microbatches=4,
                 recompute="none", zero=1, sequence_parallel=True) | config  # fmt: skip
    return gpu_memory(LLAMA, Config(**knobs), Job(8, 4096), Software("fp8", True, True, fp8=fp8))


def test_te_keeps_its_fp8_copies_beside_bf16_weights_and_none_beside_fp8_ones():
    """bf16 weights: each block matrix's fp8 cast and its transpose, two bytes a parameter more; fp8
    weights (fp8_param_gather) are those two bytes themselves, as many as bf16's; the norms (and the
    embedding and head, which no fp8 product reads) have no fp8 copy."""
    te, params, torchao = _memory("te", pp=1), _memory("te-fp8-params", pp=1), _memory("torchao", pp=1)
    assert params.weights == torchao.weights
    matrices = layer_parameters_per_gpu(LLAMA, 2) - 2 * LLAMA.norm_parameters()
    assert te.weights - params.weights == pytest.approx(2 * LLAMA.layers * matrices)
    assert te.activations == params.activations < torchao.activations


def test_fsdp_on_one_stage_copies_only_the_blocks_it_holds_gathered():
    te, params = _memory("te", pp=1, dp=4, zero=3), _memory("te-fp8-params", pp=1, dp=4, zero=3)
    matrices = layer_parameters_per_gpu(LLAMA, 2) - 2 * LLAMA.norm_parameters()
    assert te.weights - params.weights == pytest.approx(2 * 2 * matrices)


def test_bf16_runs_keep_as_before_whatever_the_fp8_setting():
    config = Config(2, 2, 2, "1f1b", 1, 1, 4, "none", 1, True)
    bf16 = Software("bf16", True, True)
    assert gpu_memory(LLAMA, config, Job(8, 4096), dataclasses.replace(bf16, fp8="te")) == gpu_memory(
        LLAMA, config, Job(8, 4096), bf16
    )


def test_an_unknown_fp8_keeping_is_refused_in_one_line():
    with pytest.raises(ValueError, match="unknown fp8 keeping 'fp4': use torchao, te, te-fp8-params"):
        Software("fp8", fp8="fp4")
