"""Reading an unmodified Hugging Face causal LM: which modules are its embedding, layers, norm and head.

Decoder-only ``*ForCausalLM`` models of ``transformers`` share one layout, whatever the family:

    <CausalLM>                      e.g. LlamaForCausalLM / GPT2LMHeadModel
      <base>                        ``base_model_prefix``: model / transformer
        input embeddings            ``get_input_embeddings()`` (+ learned positions: GPT-2's ``wpe``)
        the decoder layers          the ModuleList of ``_no_split_modules`` blocks: layers / h
        the final norm              the one other child holding parameters: norm / ln_f
        (rotary embedding, dropout) children without parameters: every stage keeps them
      <head>                        ``get_output_embeddings()``: lm_head

`find_layout` names these from the model itself, so no family is written down here; a model whose
structure does not fit is one clear error naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class NotUnderstood(ValueError):
    """A model that is not a decoder-only causal LM of the usual layout."""


@dataclass(frozen=True)
class Layout:
    """Where each piece sits, by the attribute names of the model's own modules."""

    base: str  # the base model's attribute on the CausalLM: "model", "transformer"
    layers: str  # the decoder ModuleList's attribute on the base: "layers", "h"
    num_layers: int
    embeddings: tuple[str, ...]  # input-side children of the base holding parameters: "embed_tokens"
    input_embedding: str  # the token embedding among them: "embed_tokens", "wte"
    norm: str | None  # the final norm on the base: "norm", "ln_f"
    head: str  # the LM head's attribute on the CausalLM: "lm_head"
    tied: bool  # the head's weight is the token embedding's

    @property
    def num_pieces(self) -> int:
        """The embedding, each layer, and the head (final norm included): ``layers + 2``."""
        return self.num_layers + 2

    def embedding_weight(self) -> str:
        return f"{self.base}.{self.input_embedding}.weight"


def check_causal(config) -> None:
    """Refuse encoder-decoder and encoder configs (BERT's kind, unless made a decoder) before anything is
    built: AutoModelForCausalLM has a class for some encoders, which fails later in other words."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        raise NotUnderstood(
            f"{type(config).__name__} describes an encoder-decoder model: pipeclock.models.hf splits "
            "decoder-only causal language models"
        )
    kind = getattr(config, "model_type", "")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise NotUnderstood(
            f"{type(config).__name__} describes an encoder model ({kind}): encoder models are not causal "
            "LMs; pipeclock.models.hf splits decoder-only causal language models"
        )


def find_layout(model: nn.Module) -> Layout:
    """The layout of ``model`` (built on any device, the meta one included), or `NotUnderstood`."""
    name = type(model).__name__
    check_causal(model.config)
    head_module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head_module is None:
        raise NotUnderstood(f"{name} is not a causal language model: it has no output embeddings (LM head)")
    base_name = getattr(model, "base_model_prefix", "")
    base = getattr(model, base_name, None) if base_name else None
    if not isinstance(base, nn.Module):
        raise NotUnderstood(f"{name} has no base model under its base_model_prefix {base_name!r}")
    head = _child_name(model, head_module, f"{name}'s LM head")
    _refuse_other_children(model, {base_name, head}, name)
    layers = _decoder_layers(base, model, name)
    token_embedding = _child_name(base, model.get_input_embeddings(), f"{name}'s input embeddings")
    embeddings, norm = _embeddings_and_norm(base, layers, token_embedding, name)
    tied = head_module.weight is model.get_input_embeddings().weight
    return Layout(
        base_name, layers, len(getattr(base, layers)), embeddings, token_embedding, norm, head, tied
    )


def _child_name(parent: nn.Module, child: nn.Module, what: str) -> str:
    for child_name, module in parent.named_children():
        if module is child:
            return child_name
    raise NotUnderstood(f"{what} ({type(child).__name__}) is not a direct child of {type(parent).__name__}")


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _refuse_other_children(model: nn.Module, known: set[str], name: str) -> None:
    others = [n for n, c in model.named_children() if n not in known and _holds_parameters(c)]
    if others:
        raise NotUnderstood(
            f"{name} holds parameters outside its base model and LM head: {', '.join(others)}"
        )


def _decoder_layers(base: nn.Module, model: nn.Module, name: str) -> str:
    """The base's ModuleList whose entries are the model's ``_no_split_modules`` blocks."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for child_name, child in base.named_children():
        if isinstance(child, nn.ModuleList) and len(child) and type(child[0]).__name__ in blocks:
            return child_name
    raise NotUnderstood(
        f"{name}: no decoder layer list found (a ModuleList of {sorted(blocks) or 'no _no_split_modules'} "
        f"among {type(base).__name__}'s children)"
    )


def _embeddings_and_norm(
    base: nn.Module, layers: str, token_embedding: str, name: str
) -> tuple[tuple[str, ...], str | None]:
    """The input-side embeddings (every ``nn.Embedding`` child) and the one other child with parameters."""
    embeddings, rest = [], []
    for child_name, child in base.named_children():
        if child_name == layers or not _holds_parameters(child):
            continue
        (embeddings if isinstance(child, nn.Embedding) else rest).append(child_name)
    if token_embedding not in embeddings:
        raise NotUnderstood(f"{name}'s input embeddings {token_embedding!r} are not an nn.Embedding")
    if len(rest) > 1:
        raise NotUnderstood(
            f"{name}: more than one module besides the embeddings and the layers holds parameters "
            f"({', '.join(rest)}); only a final norm is understood there"
        )
    return tuple(embeddings), (rest[0] if rest else None)
