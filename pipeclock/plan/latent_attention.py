"""Multi-head latent attention (DeepSeek-V2/V3's MLA) on paper: its products and parameters.

MLA compresses the queries through a rank ``q_lora`` (or projects them directly when it is 0) and the
keys and values through a shared latent of rank ``kv_lora``, with a rotary part of ``rope`` per head
computed from the input apart:

    q      h -> q_lora (norm) -> heads x (nope + rope)          (h -> heads x (nope + rope) without q_lora)
    kv     h -> kv_lora + rope (norm) -> heads x (nope + v)
    o      heads x v -> h

Scores take ``nope + rope`` per head and the weighted sum ``v``: a layer's attention FLOPs are those of
heads x (nope + rope + v) / 2 per head and side, which `PaperModel.q_dim` reports so that the attention
counts (FLOPs, what a layer keeps) stay the ones of ordinary attention. The down projections are small
and replicated under tensor parallel, as Megatron-Core runs them. `PaperModel` calls these with its
fields (``head_dim`` is ``nope``).
"""

from __future__ import annotations

LATENT_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim")

Product = tuple[str, int, int, str]  # (role, k, n, what tensor parallel splits), as `Gemm` takes them


def attention_width(heads: int, nope: int, rope: int, v: int) -> int:
    """What stands for ``heads x head_dim`` in the attention counts: the mean of the score's width and
    the value's, over all heads."""
    return heads * (nope + rope + v) // 2


def products(
    hidden: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int
) -> list[Product]:
    """The attention products of one MLA layer's forward, per token, in the order the layer runs them."""
    qk = nope + rope
    query = [("q_a", hidden, q_lora, "none"), ("q_b", q_lora, heads * qk, "n")] if q_lora else [
        ("q", hidden, heads * qk, "n")
    ]  # fmt: skip
    return [
        *query,
        ("kv_a", hidden, kv_lora + rope, "none"),
        ("kv_b", kv_lora, heads * (nope + v), "n"),
        ("o", heads * v, hidden, "k"),
    ]


def norm_parameters(q_lora: int, kv_lora: int, per_width: int) -> int:
    """The norms of the two latents (``per_width`` 1 for RMSNorm, 2 for LayerNorm)."""
    return (q_lora + kv_lora) * per_width


def fields(config) -> dict:
    """The `PaperModel` fields of a Hugging Face config's latent attention (none for other attention):
    ``head_dim`` is the plain (non-rotary) part of a query's head."""
    kv_lora = getattr(config, "kv_lora_rank", None)
    if not isinstance(kv_lora, int) or kv_lora < 1:
        return {}
    return {
        "kv_lora": kv_lora,
        "q_lora": getattr(config, "q_lora_rank", None) or 0,
        "rope_dim": getattr(config, "qk_rope_head_dim", 0) or 0,
        "v_head_dim": config.v_head_dim,
        "head_dim": config.qk_nope_head_dim,
    }
