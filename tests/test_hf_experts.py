"""Mixtures of experts from ``transformers`` in ``pipeclock.models.hf``, in one process: the routers'
auxiliary loss summed across stages as ``transformers`` adds it, and experts fused in memory read back from
the per-expert tensors on disk, ``save_pretrained``'s or pipeclock's own export."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from pipeclock.models import hf
from tests.hf_cases import padded_batch


def moe_families():
    """Mixtral and Qwen3-MoE: experts fused in memory (one gate_up_proj for all), per expert on disk."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, num_experts_per_tok=2)  # fmt: skip
    return [MixtralConfig(**sizes, num_local_experts=4), Qwen3MoeConfig(**sizes, num_experts=4,
                                                                       moe_intermediate_size=16)]  # fmt: skip


def aux_loss_families():
    """Mixtral, Qwen2-MoE and Qwen3-MoE with their routers' auxiliary loss in the loss."""
    from transformers import Qwen2MoeConfig

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, num_experts_per_tok=2)  # fmt: skip
    qwen2 = Qwen2MoeConfig(
        **sizes, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16
    )
    configs = [*moe_families(), qwen2]
    for config in configs:
        config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    return configs


@pytest.mark.parametrize("config", aux_loss_families(), ids=lambda c: type(c).__name__)
def test_the_routers_auxiliary_loss_is_summed_across_stages_as_transformers_adds_it(config):
    """One step on 1, 3 and 5 stages (every layer alone): the loss and gradients of transformers' own
    ``model(ids, attention_mask, labels=labels)``, auxiliary loss included (it moves the loss)."""
    from transformers import AutoModelForCausalLM

    from pipeclock import schedule
    from pipeclock.engine.ties import tie_key

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf.prepared_config(config))
    hf.keyed(model, 5)
    inputs, labels = padded_batch(4, 8, seed=3)
    out = model(input_ids=inputs[0], attention_mask=inputs[1], labels=labels)
    out.loss.backward()
    assert out.aux_loss.item() > 0.1, "the auxiliary loss counts"
    for chunks in (1, 3, 5):
        stages = hf.split(model, 0, 1, chunks=chunks, seed=5)
        stages = stages if isinstance(stages, list) else [stages]
        name = "interleaved-1f1b" if chunks > 1 else "1f1b"
        loss = schedule.Pipeline(stages, name, 1, hf.loss(config)).step(inputs, labels)
        assert loss == pytest.approx(out.loss.item(), rel=1e-6), chunks
        wanted = dict(model.named_parameters())
        for stage in stages:
            for name, parameter in stage.named_parameters():
                want = wanted[tie_key(parameter) or name].grad
                assert torch.allclose(parameter.grad, want, rtol=1e-5, atol=1e-7), (chunks, name)


@pytest.mark.parametrize("config", moe_families(), ids=lambda c: type(c).__name__)
def test_a_mixture_of_experts_reads_back_from_save_pretrained_and_from_its_own_export(config, tmp_path):
    """Each of 3 ranks reads its experts from the per-expert tensors transformers writes, fused as
    transformers fuses them; the stages written by ``hf.save_pretrained`` read back the same."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(tmp_path / "saved"))
    state = model.state_dict()
    stages = [hf.split(str(tmp_path / "saved"), rank, 3) for rank in range(3)]
    assert any("experts.gate_up_proj" in name for stage in stages for name, _ in stage.named_parameters())
    for stage in stages:
        for name, parameter in stage.named_parameters():
            assert torch.equal(parameter, state[name]), name
    hf.save_pretrained(stages, config, tmp_path / "exported")
    read = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), local_files_only=True)
    assert all(torch.equal(tensor, state[name]) for name, tensor in read.state_dict().items())
    for rank in range(3):
        for name, parameter in hf.split(str(tmp_path / "exported"), rank, 3).named_parameters():
            assert torch.equal(parameter, state[name]), name
