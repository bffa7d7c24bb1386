"""Reading an unmodified Hugging Face causal LM: where its embeddings, layers, other modules and head are.

Decoder-only ``*ForCausalLM`` models of ``transformers`` share one layout, whatever the family:

    <CausalLM>                      e.g. LlamaForCausalLM / GPT2LMHeadModel / OPTForCausalLM
      <base>                        ``base_model_prefix``: model / transformer (OPT: model.decoder)
        before the layers           modules with parameters its forward calls first: the embeddings
                                    (``get_input_embeddings()``, learned positions), BLOOM's embedding
                                    norm, OPT's input projection
        the decoder layers          a ModuleList, of ``_no_split_modules`` blocks where the family says
                                    (under the module holding it: BERT's encoder)
        after the layers            modules with parameters its forward calls last: the final norm(s),
                                    OPT's output projection
        (rotary embedding, norms    modules without parameters: every stage keeps them, and runs them
         without weights, dropout)  where the model's own forward does
      <head>                        ``get_output_embeddings()``: lm_head, and whatever else the
                                    CausalLM holds besides the base (BERT's prediction transform)

Whether a module runs before or after the layers is read from the base's own ``forward`` (the first
line that names it, against the first that names the layer list); an embedding always runs before.
`find_layout` names everything from the model itself, so no family is written down here; a model
whose structure does not fit is one clear error naming what is missing.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn


class NotUnderstood(ValueError):
    """A model that is not a decoder-only causal LM of the usual layout."""


@dataclass(frozen=True)
class Layout:
    """Where each piece sits, by the dotted paths of the model's own modules from the CausalLM."""

    base: str  # the module holding the layer list: "model", OPT's "model.decoder", BERT's "bert.encoder"
    layers: str  # the decoder ModuleList's attribute on the base: "layers", "h"
    num_layers: int
    embeddings: tuple[str, ...]  # what runs before the layers and holds parameters (modules or parameters,
    # on the base or on the modules above it): "model.embed_tokens", BERT's "bert.embeddings"
    input_embedding: str  # the token embedding: "model.embed_tokens", "transformer.wte"
    after: tuple[str, ...]  # what runs after the layers and holds parameters: "model.norm"
    head: str  # the output embedding: "lm_head", BERT's "cls.predictions.decoder"
    tied: bool  # the head's weight is the token embedding's
    tuple_outputs: bool = False  # the base model takes its layers' hidden states from a tuple they return
    head_side: tuple[str, ...] = ()  # the CausalLM's children besides the base: "lm_head", BERT's "cls"

    @property
    def num_pieces(self) -> int:
        """The embedding, each layer, and the head (final norm included): ``layers + 2``."""
        return self.num_layers + 2

    def embedding_weight(self) -> str:
        return f"{self.input_embedding}.weight"

    def base_of(self, causal_lm: nn.Module) -> nn.Module:
        """The module holding the layers, in ``causal_lm`` (or in a stage, which keeps the same path)."""
        return causal_lm.get_submodule(self.base)


def check_causal(config) -> None:
    """Refuse an encoder config (BERT's kind, unless made a decoder) before anything is built: its
    AutoModelForCausalLM class would attend both ways. (An encoder-decoder's decoder alone is split.)"""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return
    kind = getattr(config, "model_type", "")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise NotUnderstood(
            f"{type(config).__name__} describes an encoder model ({kind}): encoder models are not causal "
            "LMs; pipeclock.models.hf splits decoder-only causal language models"
        )


def find_layout(model: nn.Module) -> Layout:
    """The layout of ``model`` (built on any device, the meta one included), or `NotUnderstood`."""
    name = type(model).__name__
    head_module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head_module is None:
        raise NotUnderstood(f"{name} is not a causal language model: it has no output embeddings (LM head)")
    _refuse_encoder(model, name)
    base_name, base = _base_model(model, name)
    head = _path_of(model, head_module)
    if head is None or head.split(".")[0] == base_name:
        raise NotUnderstood(f"{name}'s LM head ({type(head_module).__name__}) is not outside its base model")
    side = tuple(n for n, c in model.named_children() if n != base_name and holds_parameters(c))
    if any(p.requires_grad for p in model.parameters(recurse=False)):
        raise NotUnderstood(f"{name} holds parameters of its own besides its base model and LM head")
    chain = _chain_to_layers(base_name, base, name)
    path, holder = chain[-1]
    layers = _decoder_layers(holder, model, name)
    token_embedding = _path_of(model, model.get_input_embeddings())
    if token_embedding is None or not token_embedding.startswith(f"{base_name}."):
        raise NotUnderstood(f"{name}'s input embeddings are not in its base model")
    before, after = _before_and_after(chain, layers, token_embedding, name)
    tied = getattr(head_module, "weight", None) is model.get_input_embeddings().weight
    count = len(getattr(holder, layers))
    indexed = _indexes_layer_outputs(type(holder), layers)
    return Layout(path, layers, count, before, token_embedding, after, head, tied, indexed, side)


def _refuse_encoder(model: nn.Module, name: str) -> None:
    """An encoder family whose CausalLM asks for ``is_decoder=True`` sees the whole sequence without it."""
    try:
        asks = "is_decoder" in inspect.getsource(type(model).__init__)
    except (OSError, TypeError):
        asks = False
    if asks and not getattr(model.config, "is_decoder", False):
        raise NotUnderstood(
            f"{name} is an encoder: its attention sees the whole sequence, so it is not a causal LM "
            "unless its config sets is_decoder=True"
        )


def _base_model(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The base model: under ``base_model_prefix``, or else the one child holding the input embeddings."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if isinstance(base, nn.Module):
        return prefix, base
    embedding = model.get_input_embeddings()
    holding = [(n, c) for n, c in model.named_children() if any(m is embedding for m in c.modules())]
    if len(holding) != 1:
        raise NotUnderstood(f"{name} has no base model under its base_model_prefix {prefix!r}")
    return holding[0]


def _path_of(parent: nn.Module, module: nn.Module) -> str | None:
    return next((n for n, m in parent.named_modules() if m is module and n), None)


def holds_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds weights that train (frozen ones, a sinusoidal table, are constants that
    every stage keeps, as buffers)."""
    return any(p.requires_grad for p in module.parameters())


def _has_layer_list(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList) and len(m) for m in module.modules())


def _chain_to_layers(path: str, base: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """The modules from the base down to the one holding the layer list (BERT: the model, its encoder),
    following the one child that holds a module list at each level."""
    chain = [(path, base)]
    while not any(isinstance(c, nn.ModuleList) and len(c) for c in base.children()):
        below = [(n, c) for n, c in base.named_children() if _has_layer_list(c)]
        if len(below) != 1:
            found = ", ".join(n for n, _ in below) or "none"
            raise NotUnderstood(
                f"{name}: no one decoder layer list found under {type(base).__name__} (parts holding "
                f"layers: {found}); of a multimodal model, give the config of its text model"
            )
        child_name, base = below[0]
        path = f"{path}.{child_name}"
        chain.append((path, base))
    return chain


def _decoder_layers(base: nn.Module, model: nn.Module, name: str) -> str:
    """The base's ModuleList of the model's ``_no_split_modules`` blocks, or its only ModuleList."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(n, c) for n, c in base.named_children() if isinstance(c, nn.ModuleList) and len(c)]
    named = [n for n, c in lists if type(c[0]).__name__ in blocks]
    if len(named) == 1 or (not named and len(lists) == 1):
        return (named or [lists[0][0]])[0]
    raise NotUnderstood(
        f"{name}: no one decoder layer list found (a ModuleList of {sorted(blocks) or 'blocks'} "
        f"among {type(base).__name__}'s children {[n for n, _ in lists]})"
    )


def _before_and_after(
    chain: list[tuple[str, nn.Module]], layers: str, token_embedding: str, name: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What holds parameters beside the way down to the layers, at each level, run before the layers or
    after them: by the order each level's forward first names it and the way down."""
    before, after = [], []
    for depth, (path, module) in enumerate(chain):
        down = chain[depth + 1][0].rsplit(".", 1)[1] if depth + 1 < len(chain) else layers
        order = _first_mentions(type(module))
        holding = [(n, c) for n, c in module.named_children() if n != down and holds_parameters(c)]
        trained = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        for child_name, child in [*holding, *trained]:
            full = f"{path}.{child_name}"
            embeds = (
                isinstance(child, nn.Embedding)
                or token_embedding.startswith(f"{full}.")
                or (full == token_embedding)
            )
            if embeds:
                before.append(full)
            elif child_name in order and down in order:
                (before if order[child_name] < order[down] else after).append(full)
            else:
                raise NotUnderstood(
                    f"{name}: {type(module).__name__}.forward does not say where {child_name} "
                    f"({type(child).__name__}) runs, before or after the decoder layers"
                )
    return tuple(before), tuple(after)


def _first_mentions(cls: type) -> dict[str, int]:
    """Each ``self.<name>`` in ``cls.forward``'s source, with the position it is first named at."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return {}
    found: dict[str, int] = {}
    for match in re.finditer(r"self\.(\w+)", source):
        found.setdefault(match.group(1), match.start())
    return found


def _indexes_layer_outputs(cls: type, layers: str) -> bool:
    """True when ``cls.forward`` reads a layer's hidden states as ``outputs[0]`` of what the layer returns
    (the loop ``for layer in self.<layers>``, then ``outputs = layer(...)`` and ``outputs[0]``)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    loop = re.search(rf"for\s+(?:\w+\s*,\s*)?(\w+)\s+in\s+(?:enumerate\()?self\.{layers}\b", source)
    if loop is None:
        return False
    call = re.search(rf"(\w+)\s*=\s*{loop.group(1)}\(", source[loop.end() :])
    return call is not None and re.search(rf"\b{call.group(1)}\[0\]", source) is not None
