"""One stage of a Hugging Face causal LM: some of its pieces, run by the model's own code.

What a stage does not hold it does not rewrite either. The causal mask (for whatever attention
implementation the config names), the rotary embedding's cos and sin, the position ids and the embedding's
scaling come from the base model's own ``forward``, run as a *prelude*: the base model with its decoder
layers replaced by stand-ins that record how each layer is called, and, on a stage without the
embeddings, with those replaced by zeros of no size (only the shapes and dtypes matter there). The stage
then calls its own layers as the base model would have, with its own hidden states. The head runs the
CausalLM's own ``forward`` over a stand-in base that returns the normed hidden states, so logit scaling or
soft-capping stays the family's.

What travels between stages is plain tensors: the hidden states (their gradient flows back), and the
``attention_mask`` when the batch has one (int64, forward only). Positions are the model's own default,
``0 .. tokens - 1``, rebuilt on every stage, as ``model(input_ids, attention_mask, labels=...)`` does.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Sequence

import torch
from torch import nn

from pipeclock.models.hf.structure import Layout


class _StopPrelude(Exception):
    """Raised by the last layer stand-in a stage needs: the rest of the base model's forward is skipped."""


class _LayerCall(nn.Module):
    """Stands in for decoder layer ``index`` in the prelude: records its arguments, passes the input on.

    Plain attributes of the real layer (``attention_type``, ``layer_idx`` ...) are copied, since some
    base models read them to choose a layer's mask.
    """

    def __init__(self, index: int, layer: nn.Module, record: dict):
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_") and isinstance(value, str | int | float | bool | type(None)):
                setattr(self, name, value)
        self.index, self.record = index, record

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.record[self.index] = (hidden, args[1:], kwargs)
        if self.index >= self.record["stop_after"]:
            raise _StopPrelude
        return hidden


class _NoEmbedding(nn.Module):
    """An input embedding this stage does not hold: a zero that broadcasts (its value is never used)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=ids.device)


class _NormedHidden(nn.Module):
    """Stands in for the base model in the CausalLM's own forward: the final norm of the given states."""

    def __init__(self, norm: nn.Module | None):
        super().__init__()
        object.__setattr__(self, "norm", norm)  # not a submodule: the stage holds it under its own name

    def forward(self, *args, inputs_embeds: torch.Tensor, **kwargs):
        return _BaseOutput(inputs_embeds if self.norm is None else self.norm(inputs_embeds))


class _BaseOutput:
    """What a base model returns, as far as a CausalLM's forward reads it: the last hidden states (by
    name or first index); every other field (cache, attentions ...) is None."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.last_hidden_state,)[index]

    def __getattr__(self, name: str) -> None:
        return None


def _shallow(module: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A copy of ``module`` that runs its own ``forward`` over other children (its tensors not copied)."""
    runner = copy.copy(module)
    runner._modules = dict(children)
    runner._parameters, runner._buffers = {}, {}
    return runner


class HFStage(nn.Module):
    """A run of consecutive pieces (embedding, decoder layers, head) of one causal LM, under HF's names.

    ``forward`` takes token ids (or ``(ids, attention_mask)``) on the first stage, the previous stage's
    output elsewhere; it returns ``hidden`` or ``(hidden, attention_mask)``, and logits on the last stage.
    """

    def __init__(self, causal_lm: nn.Module, layout: Layout, pieces: range, keep: Sequence[str]):
        super().__init__()
        self.layout, self.pieces = layout, pieces
        self.has_embedding = pieces.start == 0
        self.has_head = pieces.stop == layout.num_pieces
        self.layer_indices = [i - 1 for i in pieces if 0 < i <= layout.num_layers]
        base = getattr(causal_lm, layout.base)
        own = self._own_base_children(base, keep)
        self.add_module(layout.base, _shallow(base, own))
        if self.has_head:
            self.add_module(layout.head, getattr(causal_lm, layout.head))
        self._record: dict = {}
        object.__setattr__(self, "_prelude", self._make_prelude(base))
        head_runner = _shallow(
            causal_lm, {layout.base: _NormedHidden(self._norm()), layout.head: self._head()}
        )
        object.__setattr__(self, "_head_runner", head_runner if self.has_head else None)

    # --- what this stage holds ------------------------------------------------------------------------

    def _own_base_children(self, base: nn.Module, keep: Sequence[str]) -> dict[str, nn.Module]:
        layout, own = self.layout, {}
        for name, child in base.named_children():
            if name == layout.layers:
                layers = {str(i): child[i] for i in self.layer_indices}
                own[name] = nn.ModuleDict(layers)
            elif name in layout.embeddings:
                if self.has_embedding:
                    own[name] = child
            elif name == layout.norm:
                if self.has_head:
                    own[name] = child
            elif name in keep:  # parameterless helpers every stage runs: rotary embedding, dropout
                own[name] = child
        return own

    def _base(self) -> nn.Module:
        return getattr(self, self.layout.base)

    def _norm(self) -> nn.Module | None:
        return getattr(self._base(), self.layout.norm) if self.has_head and self.layout.norm else None

    def _head(self) -> nn.Module | None:
        return getattr(self, self.layout.head) if self.has_head else None

    def decoder_layers(self) -> list[nn.Module]:
        """This stage's decoder layers, in order (the blocks ``--recompute every-K`` checkpoints)."""
        return list(getattr(self._base(), self.layout.layers).values())

    pipeline_blocks = decoder_layers

    def _make_prelude(self, base: nn.Module) -> nn.Module | None:
        """The base model's own forward over stand-ins for the layers (and for absent embeddings)."""
        if not self.layer_indices and not self.has_embedding:
            return None
        layers = getattr(base, self.layout.layers)
        calls = nn.ModuleList(_LayerCall(i, layer, self._record) for i, layer in enumerate(layers))
        children = {}
        for name, child in base.named_children():
            if name == self.layout.layers:
                children[name] = calls
            elif name in self.layout.embeddings:
                children[name] = child if self.has_embedding else _NoEmbedding()
            elif name == self.layout.norm:
                children[name] = nn.Identity()
            elif self.has_embedding or not _is_dropout(child):
                children[name] = child
            else:
                children[name] = nn.Identity()  # an embedding dropout off the first stage: nothing to drop
        return _shallow(base, children)

    # --- running ----------------------------------------------------------------------------------------

    def _layer_calls(self, hidden_or_ids: torch.Tensor, mask: torch.Tensor | None, **prelude) -> dict:
        """Run the prelude: each needed layer's (input, args, kwargs) as the base model would call it."""
        self._record.clear()
        self._record["stop_after"] = self.layer_indices[-1] if self.layer_indices else 0
        given = (
            {"input_ids": hidden_or_ids} if self.has_embedding else {"inputs_embeds": hidden_or_ids.detach()}
        )
        with contextlib.suppress(_StopPrelude):
            self._prelude(**given, attention_mask=mask, **(prelude or {"use_cache": False}))
        record = dict(self._record)
        self._record.clear()
        return record

    def forward(self, inputs):
        first, mask = _unpack(inputs)
        hidden = self._through_layers(first, mask)
        if self.has_head:
            return self._head_runner(inputs_embeds=hidden, use_cache=False).logits
        return hidden if mask is None else (hidden, mask)

    def forward_cached(self, inputs: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Generation's forward: the tokens at ``positions`` (``(1, n)``) after those whose keys and
        values ``cache`` holds (a transformers ``Cache``, None on a stage without layers; its layers grow
        by ``n``) -> their hidden states, or their logits on the head's stage."""
        prelude = {"position_ids": positions, "use_cache": cache is not None}
        if cache is not None:
            prelude[_cache_argument(self._prelude)] = cache
        hidden = self._through_layers(inputs, None, **prelude)
        if self.has_head:
            return self._head_runner(inputs_embeds=hidden, use_cache=False).logits
        return hidden

    def _through_layers(self, first: torch.Tensor, mask: torch.Tensor | None, **prelude) -> torch.Tensor:
        hidden = first
        if self._prelude is not None:
            calls = self._layer_calls(first, mask, **prelude)
            if self.has_embedding:
                hidden = calls[self.layer_indices[0] if self.layer_indices else 0][0]
            layers = getattr(self._base(), self.layout.layers)
            for index in self.layer_indices:
                _, args, kwargs = calls[index]
                hidden = _first_tensor(layers[str(index)](hidden, *args, **kwargs))
        return hidden

    def extra_repr(self) -> str:
        return f"pieces={self.pieces.start}..{self.pieces.stop - 1} of {self.layout.num_pieces}"


def _unpack(inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(inputs, torch.Tensor):
        return inputs, None
    if isinstance(inputs, list | tuple) and len(inputs) == 2:
        return inputs[0], inputs[1]
    if isinstance(inputs, dict) and "input_ids" in inputs:
        return inputs["input_ids"], inputs.get("attention_mask")
    raise TypeError(
        "an HF stage takes token ids, (ids, attention_mask) or the previous stage's (hidden, attention_mask)"
    )


def _cache_argument(base: nn.Module) -> str:
    """The name a base model's ``forward`` takes its cache by: ``cache``, or ``past_key_values`` before
    transformers 5.x renamed it."""
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _first_tensor(output) -> torch.Tensor:
    """A decoder layer's hidden states, whether it returns them alone or first in a tuple."""
    return output[0] if isinstance(output, tuple | list) else output


def _is_dropout(module: nn.Module) -> bool:
    return "Dropout" in type(module).__name__
