"""Every causal-LM type the installed ``transformers`` knows, as a tiny config (for the family sweep).

`tiny_config` takes a type's default config and shrinks every size field it recognises (widths, heads,
layers, experts, state sizes, vocabulary), keeping the ratios a family's code checks (head dim times
heads, groups dividing heads, per-layer lists as long as the layers). Nothing is written per family
except where a family's defaults cannot be shrunk by these rules: `OVERRIDES`.

What draws random numbers is turned on, so that the sweep sees it keyed: every dropout field at 0.1
(LayerDrop included), a router's jitter at 0.01, and the routers' auxiliary loss
(``output_router_logits``) wherever a family has it.
"""

from __future__ import annotations

import warnings

VOCAB = 160
LAYERS = 4
HIDDEN = 32
HEADS = 4
HEAD_DIM = HIDDEN // HEADS

# field -> tiny value, applied to every config (and sub-config) that has the field
SIZES: dict[str, int] = {
    # widths
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "dim": HIDDEN, "embedding_dim": HIDDEN,
    "embed_dim": HIDDEN, "word_embed_proj_dim": HIDDEN, "emb_dim": HIDDEN, "attention_hidden_size": HIDDEN,
    "embedding_size": HIDDEN, "lru_width": HIDDEN, "backbone_hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN, "n_inner": 2 * HIDDEN, "ffn_dim": 2 * HIDDEN, "d_ff": 2 * HIDDEN,
    "dim_ff": 2 * HIDDEN, "ffn_hidden_size": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN,
    "encoder_ffn_dim": 2 * HIDDEN, "d_inner": 2 * HIDDEN, "dff": 2 * HIDDEN,
    "intermediate_size_mlp": 2 * HIDDEN, "feed_forward_size": 2 * HIDDEN,
    "dense_intermediate_size": 2 * HIDDEN,
    "moe_intermediate_size": HIDDEN, "shared_expert_intermediate_size": HIDDEN,
    "shared_intermediate_size": HIDDEN, "expert_ffn_hidden_size": HIDDEN,
    "moe_shared_expert_intermediate_size": HIDDEN, "shared_experts_intermediate_size": HIDDEN,
    # layers
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS,
    "decoder_layers": LAYERS, "encoder_layers": LAYERS, "num_blocks": LAYERS,
    "num_decoder_layers": LAYERS, "num_encoder_layers": LAYERS,
    # attention
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS, "attention_heads": HEADS,
    "num_decoder_attention_heads": HEADS, "num_encoder_attention_heads": HEADS,
    "num_key_value_heads": 2, "num_kv_heads": 2, "num_query_groups": 2, "multi_query_group_num": 2,
    "head_dim": HEAD_DIM, "attention_head_dim": HEAD_DIM, "d_head": HEAD_DIM, "dim_head": HEAD_DIM,
    "kv_channels": HEAD_DIM, "attention_head_size": HEAD_DIM,
    "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": 2, "swa_head_dim": HEAD_DIM,
    "qk_rope_head_dim": HEAD_DIM, "qk_nope_head_dim": HEAD_DIM, "v_head_dim": HEAD_DIM,
    "qk_head_dim": 2 * HEAD_DIM,
    "kv_lora_rank": 8, "q_lora_rank": 16, "o_lora_rank": 8, "o_groups": 2,
    "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4, "index_topk_blocks": 2, "index_block_size": 4,
    "rotary_dim": 4, "partial_rotary_dim": 4,
    "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "linear_num_key_heads": 2,
    "linear_num_value_heads": HEADS, "linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "n_group": 2, "topk_group": 1,
    "num_expert_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "zero_expert_num": 1,
    # state-space and recurrent
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "mamba_d_ssm": HIDDEN, "mamba_n_heads": 4,
    "mamba_d_head": HEAD_DIM, "mamba_num_heads": 4, "mamba_head_dim": HEAD_DIM, "mamba_headdim": HEAD_DIM,
    "n_mamba_heads": 4, "mamba_dt_rank": 4, "time_step_rank": 4, "mamba_chunk_size": 8, "chunk_size": 8,
    "n_groups": 1, "mamba_n_groups": 1, "mamba_ngroups": 1, "conv_kernel": 4,
    # positions and vocabulary
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "context_length": 64, "max_target_positions": 64, "max_source_positions": 64,
    "original_max_position_embeddings": 64, "sliding_window": 4, "sliding_window_size": 4,
    "attention_window_size": 4, "local_attention_window_len": 4, "window_size": 4, "attention_chunk_size": 4,
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 4,
    "laurel_rank": 4, "adapter_rank": 4, "gated_norm_rank": 4, "loop_gate_rank": 4,
    "num_kv_shared_layers": 0, "block_size": 4, "floor_scale": 4,
}  # fmt: skip

# size fields some defaults leave None that a family's code still divides by
NONE_FILLED = (
    "head_dim",
    "num_key_value_heads",
    "num_experts_per_tok",
    "n_routed_experts",
    "n_shared_experts",
)

# tokens whose ids must fall inside the tiny vocabulary
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id",
             "decoder_start_token_id")  # fmt: skip


def causal_lm_types() -> list[str]:
    """Every model type ``AutoModelForCausalLM`` maps to a class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    """The type's default config with every recognised size shrunk; raises what the config raises."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cls()
        values = _shrunk(default.to_dict())
        if _asks_for_decoder(model_type):
            values["is_decoder"] = True  # an encoder family's causal LM: its decoder form
        values.update(OVERRIDES.get(model_type, {}))
        return cls(**{k: v for k, v in values.items() if k not in ("transformers_version", "model_type")})


def _asks_for_decoder(model_type: str) -> bool:
    """Whether the type's CausalLM needs ``is_decoder=True`` to be causal (BERT and its kin)."""
    import inspect

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    try:
        return cls is not None and "is_decoder" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False


def _shrunk(values: dict) -> dict:
    layers = _layer_count(values)
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):  # per layer
            out[key] = {
                k: _shrunk(v) if isinstance(v, dict) else v for k, v in value.items() if int(k) < LAYERS
            }
        elif isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = _shrunk(value)
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = min(value, SIZES[key]) if key in ("num_kv_shared_layers",) else SIZES[key]
        elif key in NONE_FILLED and value is None:
            out[key] = SIZES[key]
        elif key in SIZES and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[key] = [SIZES[key]] * min(len(value), LAYERS) if layers and len(value) == layers else value
        elif isinstance(value, list) and layers and len(value) == layers:
            out[key] = value[:LAYERS]
        elif _draws(key) and isinstance(value, float) and not isinstance(value, bool):
            out[key] = 0.01 if "jitter" in key else 0.1
        elif key == "output_router_logits":
            out[key] = True
        elif key in TOKEN_IDS and isinstance(value, int) and value >= VOCAB:
            out[key] = VOCAB - 1
        elif key in TOKEN_IDS and isinstance(value, list):
            out[key] = [min(v, VOCAB - 1) for v in value]
        else:
            out[key] = value
    _keep_head_ratio(values, out)
    return out


def _keep_head_ratio(values: dict, out: dict) -> None:
    """Key-value heads as many as query heads (multi-head, MLA), or one (multi-query), as the default."""
    for heads, kv in (("num_attention_heads", "num_key_value_heads"), ("n_head", "num_kv_heads")):
        want, have = values.get(heads), values.get(kv)
        if isinstance(want, int) and isinstance(have, int) and kv in out:
            out[kv] = out[heads] if have == want else (1 if have == 1 else out[kv])


def _draws(key: str) -> bool:
    """A probability the model draws random numbers with in training (dropout, LayerDrop, jitter)."""
    return ("dropout" in key or "pdrop" in key or "layerdrop" in key or "jitter" in key) and (
        "classifier" not in key
    )


def _layer_count(values: dict) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(values.get(key), int):
            return values[key]
    return None


# what the rules above cannot shrink (a family's own constraints between fields)
OVERRIDES: dict[str, dict] = {
    "diffllama": {"attention_dropout": 0.0},  # refused by its model: "no paper-backed" dropout there
    "bamba": {"mamba_n_heads": 8},
    "granitemoehybrid": {"mamba_n_heads": 8},
    "mamba2": {"num_heads": 8},
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    "zaya": {"num_experts_per_tok": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "ernie4_5_moe": {"moe_k": 2, "moe_num_experts": 4, "moe_layer_end_index": LAYERS - 1},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    },
}
