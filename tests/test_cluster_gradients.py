"""What a framework keeps of each gradient: fp32 alone (Megatron-LM's main_grad, FSDP), or DeepSpeed's
BF16_Optimizer's bf16 gradients beside its fp32 accumulation buffer (the BLOOM run's 60 GB)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import gpu_memory
from pipeclock.plan.paper_model import PaperModel

MODEL = PaperModel("test 1.2B", layers=16, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632,
                   vocab=32000)  # fmt: skip
JOB = Job(64, 2048)
BLOOM = Path(__file__).resolve().parent.parent / "docs" / "cluster" / "bloom-176b.json"


def config(zero: int, pp: int = 2) -> Config:
    return Config(tp=2, pp=pp, dp=4, schedule="1f1b", chunks=1, microbatch_size=1, microbatches=16,
                  recompute="full", zero=zero, sequence_parallel=False)  # fmt: skip


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_bf16_gradients_beside_fp32_add_two_bytes_a_held_parameter_whole(zero):
    fp32 = gpu_memory(MODEL, config(zero), JOB, Software("bf16"))
    both = gpu_memory(MODEL, config(zero), JOB, Software("bf16", gradients="bf16+fp32"))
    held = fp32.weights / 2  # the bf16 copy: two bytes a parameter the GPU holds
    assert both.gradients - fp32.gradients == pytest.approx(2 * held)
    assert (both.weights, both.optimizer, both.activations) == (
        fp32.weights,
        fp32.optimizer,
        fp32.activations,
    )


def test_fp32_training_and_fsdp_keep_no_bf16_gradients():
    for software, zero in (
        (Software("fp32", gradients="bf16+fp32"), 1),
        (Software("bf16", gradients="bf16+fp32"), 3),
    ):
        assert gpu_memory(MODEL, config(zero), JOB, software) == gpu_memory(
            MODEL, config(zero), JOB, Software(software.dtype)
        )


def test_an_unknown_gradient_keeping_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="use fp32 or bf16\\+fp32"):
        Software("bf16", gradients="fp16")


def test_blooms_run_holds_about_its_published_60_gb():
    transformers = pytest.importorskip("transformers")
    from pipeclock.plan.hf_paper import paper_model

    model = paper_model(transformers.AutoConfig.from_pretrained(str(BLOOM)))
    bloom = Config(tp=4, pp=12, dp=8, schedule="1f1b", chunks=1, microbatch_size=2, microbatches=128,
                   recompute="full", zero=1, sequence_parallel=False)  # fmt: skip
    memory = gpu_memory(model, bloom, Job(2048, 2048), Software("bf16", fused=True, gradients="bf16+fp32"))
    assert memory.total / 1e9 == pytest.approx(60, rel=0.05)
