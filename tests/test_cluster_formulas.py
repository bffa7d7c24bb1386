"""The cluster planner's model on paper against real models on this CPU: parameters, FLOPs, and what a
layer keeps for its backward, measured."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeclock.plan.activations import head_bytes, layer_bytes
from pipeclock.plan.hf_paper import NotCausalLM, paper_model, read_config

transformers = pytest.importorskip("transformers")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cluster"


def tiny_configs() -> dict:
    t = transformers
    small = dict(num_attention_heads=4, num_hidden_layers=2, vocab_size=300)
    llama = dict(hidden_size=64, intermediate_size=176, **small)
    return {
        "llama, grouped-query": t.LlamaConfig(num_key_value_heads=2, **llama),
        "llama, tied": t.LlamaConfig(tie_word_embeddings=True, **llama),
        "gpt2": t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=128),
        "qwen2, qkv biases": t.Qwen2Config(num_key_value_heads=2, **llama),
        "mixtral, experts": t.MixtralConfig(hidden_size=64, intermediate_size=96, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2, **small),
        "qwen2-moe, shared expert": t.Qwen2MoeConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, num_key_value_heads=2, **llama),
        "gpt-neox": t.GPTNeoXConfig(hidden_size=64, intermediate_size=256, **small),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(tiny_configs()))
def test_the_parameter_count_on_paper_is_the_built_models(name):
    config = tiny_configs()[name]
    built = transformers.AutoModelForCausalLM.from_config(config)
    assert paper_model(config).parameters() == sum(p.numel() for p in built.parameters())


@pytest.mark.parametrize("size", ["8b", "70b", "405b"])
def test_a_llama_config_is_counted_from_its_file_as_the_meta_model_counts_it(size):
    config = transformers.AutoConfig.from_pretrained(str(DOCS / f"llama-3.1-{size}.json"))
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    assert paper_model(config).parameters() == sum(p.numel() for p in built.parameters())


@pytest.mark.parametrize("name", ["llama, grouped-query", "gpt2", "qwen2, qkv biases"])
def test_the_forward_flops_on_paper_are_what_torch_counts(name):
    from torch.utils.flop_counter import FlopCounterMode

    config = tiny_configs()[name]
    config._attn_implementation = "eager"  # attention as two batched products torch's counter sees
    model = transformers.AutoModelForCausalLM.from_config(config)
    batch, seq = 2, 32
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    paper = paper_model(config)
    per_token = paper.layers * (paper.layer_gemm_flops() + paper.attention_flops(seq, causal=False))
    per_token += paper.head_gemm_flops()  # the eager products compute attention's whole square
    assert counter.get_total_flops() == pytest.approx(per_token * batch * seq, rel=1e-9)


def test_mfu_counts_six_flops_per_matrix_parameter_and_attentions_square_three_times():
    paper = paper_model(tiny_configs()["llama, grouped-query"])
    forward = paper.layers * (paper.layer_gemm_flops() + paper.attention_flops(128, causal=False))
    assert paper.model_flops_per_token(128) == pytest.approx(3 * (forward + paper.head_gemm_flops()))


def test_a_config_that_is_not_a_causal_lm_is_refused_by_name():
    with pytest.raises(NotCausalLM, match=r"T5Config .* is not a causal language model"):
        paper_model(transformers.T5Config())


# --- what a layer keeps, measured ---------------------------------------------------------------------


def _kept_per_token_layer(config, recompute: str, dtype=torch.float32) -> float:
    """Bytes autograd keeps per token and layer across a stack of decoder layers (parameters aside)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    batch, seq = 2, 64
    x = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq).expand(batch, -1)
    rotary = model.model.rotary_emb(x, positions)
    layer_call = functools.partial(_layer, rotary=rotary, positions=positions)
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hidden = x
        for layer in model.model.layers:
            if recompute == "full":
                hidden = checkpoint(layer_call, layer, hidden, use_reentrant=False)
            else:
                hidden = layer_call(layer, hidden)
    return sum(kept.values()) / (batch * seq * len(model.model.layers))


def _layer(layer, hidden, rotary, positions):
    return layer(hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)


def _llama(**changes):
    sizes = dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=4, vocab_size=300)  # fmt: skip
    return transformers.LlamaConfig(**(sizes | changes))


@pytest.mark.parametrize(
    ("recompute", "dtype", "bytes_per_element"),
    [("none", torch.float32, 4), ("none", torch.bfloat16, 2), ("full", torch.float32, 4)],
)
def test_what_a_layer_keeps_on_paper_is_what_autograd_keeps(recompute, dtype, bytes_per_element):
    config = _llama()
    measured = _kept_per_token_layer(config, recompute, dtype)
    assert layer_bytes(paper_model(config), recompute, bytes_per_element) == pytest.approx(measured, rel=0.05)


def test_selective_recompute_keeps_the_input_attentions_output_and_every_other_product():
    """torchtitan's op-level policy on a Llama layer: q, v, gate and down's outputs are kept (the 1st, 3rd,
    5th and 7th products), k, o and up are recomputed; measured here from the modules' own outputs."""
    config = _llama(num_hidden_layers=1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    outputs: dict[str, int] = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(layer.self_attn, name).register_forward_hook(_record(outputs, name))
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(layer.mlp, name).register_forward_hook(_record(outputs, name))
    ids = torch.randint(0, config.vocab_size, (2, 16))
    model(ids)
    tokens = 2 * 16
    kept = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    attention_output = outputs["q_proj"]  # one value per query width
    measured = tokens * config.hidden_size * 4 + sum(outputs[name] for name in kept) + attention_output
    lse = config.num_attention_heads * 4
    assert [name for name in outputs] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"]  # fmt: skip
    assert layer_bytes(paper_model(config), "selective-op", 4) == measured / tokens + lse


def test_megatrons_selective_recompute_drops_only_the_attention_cores_log_sum_exp_and_runs_it_again():
    """Korthikanti et al. 2022 recompute the attention core from the q, k, v kept: with a flash-style
    kernel (no square kept either way) that saves the log-sum-exp and costs the core's forward again."""
    from pipeclock.plan.cluster_config import Config, Job, Software
    from pipeclock.plan.cluster_time import Rates, layer_time
    from pipeclock.plan.gpus import KINDS

    model = paper_model(_llama())
    lse = model.heads * 4
    assert layer_bytes(model, "selective-attention", 2) == layer_bytes(model, "none", 2) - lse
    assert layer_bytes(model, "selective-op", 2) < layer_bytes(model, "selective-attention", 2)
    job, software = Job(4, 4096), Software("bf16")
    rates = Rates(KINDS["H100-80GB"], software)
    times = {
        recompute: layer_time(
            model, Config(1, 1, 1, "1f1b", 1, 1, 4, recompute, 0, False), job, software, rates
        )
        for recompute in ("none", "selective-attention", "selective-op")
    }
    attention = model.attention_flops(4096) * 4096 / rates.attention
    assert times["selective-attention"].recompute == pytest.approx(attention)
    assert times["selective-attention"].input_grad == pytest.approx(times["none"].input_grad + attention)
    assert times["selective-attention"].recompute < times["selective-op"].recompute


def _record(outputs: dict, name: str):
    def hook(module, inputs, output):
        outputs[name] = output.numel() * output.element_size()

    return hook


def test_the_head_keeps_its_norm_and_the_losss_fp32_log_probabilities():
    config = _llama(num_hidden_layers=1, vocab_size=2000)
    model = transformers.AutoModelForCausalLM.from_config(config)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    batch, seq = 2, 32
    hidden = torch.randn(batch, seq, config.hidden_size, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (batch, seq))
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model.lm_head(model.model.norm(hidden))
        model.loss_function(logits, labels, vocab_size=config.vocab_size)
    assert head_bytes(paper_model(config), 4) == pytest.approx(sum(kept.values()) / (batch * seq), rel=0.05)


def test_tensor_and_sequence_parallel_split_what_a_layer_keeps():
    model = paper_model(_llama())
    whole = layer_bytes(model, "none", 2, fused=True)
    assert layer_bytes(model, "none", 2, fused=True, tp=2, sp=True) == pytest.approx(whole / 2)
    assert layer_bytes(model, "none", 2, fused=True, tp=2) > whole / 2  # the norms stay whole
    assert layer_bytes(model, "full", 2, tp=2, sp=True) == layer_bytes(model, "full", 2) / 2


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "deepseek-v3"])
def test_a_config_read_without_transformers_plans_as_its_config_class(name):
    from transformers import AutoConfig

    path = DOCS / f"{name}.json"
    assert isinstance(read_config(path), SimpleNamespace)
    assert paper_model(read_config(path)) == paper_model(AutoConfig.from_pretrained(str(path)))


@pytest.mark.parametrize("field", ["first_k_dense_replace", "n_group", "q_lora_rank"])
def test_a_deepseek_config_that_leaves_a_size_to_its_class_is_read_by_transformers(tmp_path, field):
    """Where the JSON is silent, only the config class knows its default (three dense blocks first,
    eight groups of experts...): transformers reads such a config."""
    fields = json.loads((DOCS / "deepseek-v3.json").read_text())
    del fields[field]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    config = read_config(path)
    assert not isinstance(config, SimpleNamespace)
    assert paper_model(config) == paper_model(read_config(DOCS / "deepseek-v3.json"))


@pytest.mark.parametrize("name", ["llama-3.1-405b", "deepseek-v3"])
def test_planning_a_config_that_states_its_sizes_does_not_import_transformers(name):
    import subprocess
    import sys

    code = (
        "import sys; from pipeclock.plan.hf_paper import paper_model, read_config; "
        f"paper_model(read_config({str(DOCS / (name + '.json'))!r})); "
        "print('transformers' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    )
