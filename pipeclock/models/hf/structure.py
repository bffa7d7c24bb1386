"""Reading an unmodified Hugging Face causal LM: where its embeddings, layers, other modules and head are.

Decoder-only ``*ForCausalLM`` models of ``transformers`` share one layout, whatever the family:

    <CausalLM>                      e.g. LlamaForCausalLM / GPT2LMHeadModel / OPTForCausalLM
      <base>                        ``base_model_prefix``: model / transformer (OPT: model.decoder)
        before the layers           modules with parameters its forward calls first: the embeddings
                                    (``get_input_embeddings()``, learned positions), BLOOM's embedding
                                    norm, OPT's input projection
        the decoder layers          a ModuleList, of ``_no_split_modules`` blocks where the family says
        after the layers            modules with parameters its forward calls last: the final norm(s),
                                    OPT's output projection
        (rotary embedding, norms    modules without parameters: every stage keeps them, and runs them
         without weights, dropout)  where the model's own forward does
      <head>                        ``get_output_embeddings()``: lm_head

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
    """Where each piece sits, by the attribute names of the model's own modules."""

    base: str  # the dotted path from the CausalLM to the module holding the layers: "model", "model.decoder"
    layers: str  # the decoder ModuleList's attribute on the base: "layers", "h"
    num_layers: int
    embeddings: tuple[str, ...]  # what the base runs before the layers and holds parameters: children
    # ("embed_tokens") or its own parameters
    input_embedding: str  # the token embedding among them: "embed_tokens", "wte"
    after: tuple[str, ...]  # what the base runs after the layers and holds parameters: "norm"
    head: str  # the LM head's attribute on the CausalLM: "lm_head"
    tied: bool  # the head's weight is the token embedding's
    tuple_outputs: bool = False  # the base model takes its layers' hidden states from a tuple they return

    @property
    def num_pieces(self) -> int:
        """The embedding, each layer, and the head (final norm included): ``layers + 2``."""
        return self.num_layers + 2

    @property
    def norm(self) -> str | None:
        """The last module with parameters before the head (the final norm), if any."""
        return self.after[-1] if self.after else None

    def embedding_weight(self) -> str:
        return f"{self.base}.{self.input_embedding}.weight"

    def base_of(self, causal_lm: nn.Module) -> nn.Module:
        """The module holding the layers, in ``causal_lm`` (or in a stage, which keeps the same path)."""
        return causal_lm.get_submodule(self.base)


def find_layout(model: nn.Module) -> Layout:
    """The layout of ``model`` (built on any device, the meta one included), or `NotUnderstood`."""
    name = type(model).__name__
    head_module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head_module is None:
        raise NotUnderstood(f"{name} is not a causal language model: it has no output embeddings (LM head)")
    base_name = getattr(model, "base_model_prefix", "")
    base = getattr(model, base_name, None) if base_name else None
    if not isinstance(base, nn.Module):
        raise NotUnderstood(f"{name} has no base model under its base_model_prefix {base_name!r}")
    head = _child_name(model, head_module, f"{name}'s LM head", nested_hint=True)
    _refuse_other_children(model, {base_name, head}, name)
    path, holder = _layer_holder(base_name, base, name)
    layers = _decoder_layers(holder, model, name)
    token_embedding = _child_name(holder, model.get_input_embeddings(), f"{name}'s input embeddings")
    before, after = _before_and_after(holder, layers, token_embedding, name)
    tied = getattr(head_module, "weight", None) is model.get_input_embeddings().weight
    count = len(getattr(holder, layers))
    indexed = _indexes_layer_outputs(type(holder), layers)
    return Layout(path, layers, count, before, token_embedding, after, head, tied, indexed)


def _child_name(parent: nn.Module, child: nn.Module, what: str, nested_hint: bool = False) -> str:
    for child_name, module in parent.named_children():
        if module is child:
            return child_name
    hint = " (an encoder model with a language-model head is not a causal LM)" if nested_hint else ""
    raise NotUnderstood(
        f"{what} ({type(child).__name__}) is not a direct child of {type(parent).__name__}{hint}"
    )


def holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _refuse_other_children(model: nn.Module, known: set[str], name: str) -> None:
    others = [n for n, c in model.named_children() if n not in known and holds_parameters(c)]
    others += [n for n, p in model.named_parameters(recurse=False)]
    if others:
        raise NotUnderstood(
            f"{name} holds parameters outside its base model and LM head: {', '.join(others)}"
        )


def _layer_holder(path: str, base: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The module under the base that holds the layer list: the base, or (OPT's decoder) the one child
    that holds all of the base's parameters, followed down."""
    while not any(isinstance(c, nn.ModuleList) for c in base.children()):
        holding = [(n, c) for n, c in base.named_children() if holds_parameters(c)]
        if len(holding) != 1 or any(True for _ in base.parameters(recurse=False)):
            raise NotUnderstood(f"{name}: no decoder layer list found under {type(base).__name__}")
        child_name, base = holding[0]
        path = f"{path}.{child_name}"
    return path, base


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
    base: nn.Module, layers: str, token_embedding: str, name: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The children with parameters that the base's forward runs before the layers, and after them."""
    order = _first_mentions(type(base))
    before, after = [], []
    holding = [(n, c) for n, c in base.named_children() if n != layers and holds_parameters(c)]
    for child_name, child in [*holding, *base.named_parameters(recurse=False)]:
        if isinstance(child, nn.Embedding) or child_name == token_embedding:
            before.append(child_name)
        elif child_name in order and layers in order:
            (before if order[child_name] < order[layers] else after).append(child_name)
        else:
            raise NotUnderstood(
                f"{name}: {type(base).__name__}.forward does not say where {child_name} "
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
