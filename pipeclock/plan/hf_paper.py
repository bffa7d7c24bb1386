"""A Hugging Face causal LM on paper: a `PaperModel` read from its config alone.

Only ``transformers``' config classes are used, never a model: a 405B config plans on a laptop. The
sizes come from the config's own fields (``hidden_size``, ``num_key_value_heads``, ``head_dim``,
``intermediate_size``, the experts' fields of a mixture); what a config does not say (a plain GELU MLP
and LayerNorms instead of SwiGLU and RMSNorm, biases, learned positions) is read from its family, for
the families below. Only the families `checked_families` has compared with their own models are read;
any other is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from pipeclock.plan import experts as expert_parallel
from pipeclock.plan import latent_attention
from pipeclock.plan.checked_families import refusal
from pipeclock.plan.paper_model import PaperModel

# Families whose MLP is two matrices with a GELU/ReLU, whose norms are LayerNorms and whose Linears
# have biases (their modeling code says so; their configs do not).
PLAIN_MLP_FAMILIES = {"gpt2", "gpt_bigcode", "gpt_neox", "starcoder2", "falcon", "phi", "persimmon", "bloom",
                      "jais2", "opt", "biogpt", "openai-gpt", "gpt_neo"}  # fmt: skip
LEARNED_POSITIONS = {"gpt2", "gpt_bigcode", "opt", "biogpt", "openai-gpt", "gpt_neo"}
QKV_BIAS_FAMILIES = {"qwen2", "qwen2_moe"}


class NotCausalLM(ValueError):
    """A config that does not describe a causal language model."""


# Families read without importing transformers (seconds of CPU) when their config.json states each of
# these sizes: their config classes' defaults for the rest are the ones `paper_model` assumes.
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
          "num_key_value_heads")  # fmt: skip
_DEEPSEEK_V3 = ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "first_k_dense_replace", "n_group", "topk_group", "kv_lora_rank", "q_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # fmt: skip
PLAIN_JSON_FAMILIES = {"llama": _SIZES, "mistral": _SIZES, "deepseek_v3": _SIZES + _DEEPSEEK_V3}


def read_config(path: str | Path):
    """The ``transformers`` config at ``path`` (a config.json, or a directory holding one); for a
    Llama, Mistral or DeepSeek-V3 config that states its sizes, the JSON's fields alone (the same plan,
    read at once)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--hf-config {path}: no such file or directory")
    plain = _plain_json(path / "config.json" if path.is_dir() else path)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    from pipeclock.models.config_refusals import config_refusals

    try:
        with config_refusals(path):
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--hf-config {path} is not a Hugging Face config: {first}") from None


def _plain_json(path: Path) -> SimpleNamespace | None:
    """The config's fields, when it is of a `PLAIN_JSON_FAMILIES` family and states each of its sizes
    as a positive whole number, with heads that divide the width; else None (transformers reads it)."""
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict) or fields.get("model_type") not in PLAIN_JSON_FAMILIES:
        return None
    sizes = {name: fields.get(name) for name in PLAIN_JSON_FAMILIES[fields["model_type"]]}
    if not all(type(value) is int and value > 0 for value in sizes.values()):
        return None
    hidden, heads, kv_heads = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if hidden % heads or heads % kv_heads or type(fields.get("head_dim", 1)) is not int:
        return None
    return SimpleNamespace(**fields)


def paper_model(config, name: str | None = None) -> PaperModel:
    """The `PaperModel` of a causal LM's config; `NotCausalLM` for any other config."""
    family = getattr(config, "model_type", "")
    kind = type(config).__name__
    if isinstance(config, SimpleNamespace):  # a plain JSON family: causal, and read without transformers
        kind = f"{family} config"
    elif _not_causal(config, family):
        raise NotCausalLM(
            f"{kind} (model_type {family!r}) is not a causal language model: plan --hf-config takes a "
            "decoder-only *ForCausalLM config"
        )
    elif refused := refusal(family, kind):
        raise NotCausalLM(refused)
    hidden = _field(config, kind, "hidden_size")
    heads = _field(config, kind, "num_attention_heads")
    kv_heads = (
        getattr(config, "num_key_value_heads", None)
        or _falcon_kv_heads(config)
        or (1 if getattr(config, "multi_query", False) else heads)
    )
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    latent = latent_attention.fields(config)
    head_dim = latent.pop("head_dim", head_dim)
    plain = family in PLAIN_MLP_FAMILIES
    experts = _experts(config)
    per_token = getattr(config, "num_experts_per_tok", 0) if experts else 0
    if experts and not (isinstance(per_token, int) and 0 < per_token <= experts):
        raise ValueError(
            f"{kind} routes each token to num_experts_per_tok = {per_token!r} of its {experts} experts: "
            f"it must be between 1 and {experts}"
        )
    ffn = (getattr(config, "moe_intermediate_size", None) if experts else None) or _ffn(config, hidden)
    return PaperModel(
        name=name or (getattr(config, "architectures", None) or [kind])[0],
        layers=_field(config, kind, "num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        vocab=_field(config, kind, "vocab_size"),
        gated=not plain,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        norm="layer" if plain else "rms",
        qkv_bias=bool(getattr(config, "attention_bias", False)) or family in QKV_BIAS_FAMILIES,
        linear_bias=plain and bool(getattr(config, "bias", True)),
        positions=getattr(config, "max_position_embeddings", 0) if family in LEARNED_POSITIONS else 0,
        experts=experts,
        experts_per_token=per_token,
        shared_ffn=expert_parallel.shared_width(config) if experts else 0,
        **(expert_parallel.routing_fields(config) if experts else {}),
        **(_dense_first(config, hidden) if experts else {}),
        **latent,
    )


def max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None)


def _field(config, kind: str, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value < 1:
        raise NotCausalLM(f"{kind} has no {name}: plan --hf-config needs a transformer's sizes")
    return value


def _falcon_kv_heads(config) -> int | None:
    """Falcon's newer layout (40B, 180B) names its key-value heads ``num_kv_heads``."""
    return (
        getattr(config, "num_kv_heads", None) if getattr(config, "new_decoder_architecture", False) else None
    )


def _ffn(config, hidden: int) -> int:
    for name in ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * hidden


def _dense_first(config, hidden: int) -> dict[str, int]:
    """A mixture's first blocks that keep a dense MLP (DeepSeek's ``first_k_dense_replace``), of the
    config's ``intermediate_size``."""
    first = getattr(config, "first_k_dense_replace", 0)
    if not isinstance(first, int) or first < 1:
        return {}
    layers = _field(config, type(config).__name__, "num_hidden_layers")
    return {"dense_layers": min(first, layers), "dense_ffn": _ffn(config, hidden)}


def _experts(config) -> int:
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def _not_causal(config, family: str) -> bool:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    encoder = family in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    return (
        getattr(config, "is_encoder_decoder", False)
        or family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or encoder
    )
