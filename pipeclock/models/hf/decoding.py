"""One Hugging Face stage's forward during generation: a prompt's new tokens, with its own cache.

The keys and values live in transformers' own ``DynamicCache``, built from the model's config with one
cache layer per decoder layer of the whole model. The layers this stage does not hold are transformers'
``DummyLayer``: the base model then reads the sequence length and sizes its causal mask from the first
layer the stage holds, as it would from layer 0 of the whole model. Positions are given explicitly
(``start .. start + n - 1``), so a stage without decoder layers (the embedding's, or the head's alone)
needs no cache at all. As for the GPT (``models.decoding``), a prompt is computed alone (batch 1), so the
arithmetic, and the text, do not depend on the cut.
"""

from __future__ import annotations

import torch

from pipeclock.models.hf.stage import HFStage


class HFPromptCache:
    """The keys and values one prompt left in one stage's decoder layers, and the number of tokens seen."""

    def __init__(self, stage: HFStage, seq_len: int):
        self.stage, self.seq_len = stage, seq_len
        self.reset()

    def reset(self) -> None:
        """Forget every token: the next feed starts again at position 0 (a window that slid)."""
        self.length = 0
        self.cache = _stage_cache(self.stage) if self.stage.layer_indices else None

    @property
    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        held = [getattr(layer, name, None) for layer in self.cache.layers for name in ("keys", "values")]
        return sum(t.nbytes for t in held if isinstance(t, torch.Tensor))


def _stage_cache(stage: HFStage):
    from transformers import DynamicCache
    from transformers.cache_utils import DummyLayer

    cache = DynamicCache(config=stage_config(stage))
    mine = set(stage.layer_indices)
    cache.layers = [layer if index in mine else DummyLayer() for index, layer in enumerate(cache.layers)]
    return cache


def stage_config(stage: HFStage):
    """The model's config, which every stage's base model keeps."""
    return getattr(stage, stage.layout.base).config


@torch.no_grad()
def forward_cached(stage: HFStage, inputs: torch.Tensor, cache: HFPromptCache) -> torch.Tensor:
    """``inputs`` (token ids ``(1, n)`` on the embedding's stage, else hidden states ``(1, n, hidden)``)
    for the ``n`` tokens after the ``cache.length`` ones cached -> the hidden states of those tokens, or
    the logits ``(vocab,)`` of the last one on the head's stage. The cache grows by ``n``."""
    start, tokens = cache.length, inputs.shape[1]
    positions = torch.arange(start, start + tokens, device=inputs.device)[None]
    out = stage.forward_cached(inputs, positions, cache.cache)
    cache.length = start + tokens
    return out[0, -1].float() if stage.has_head else out
