"""One stage's forward during generation: a prompt's new tokens through a rank's pieces, with its cache.

A prompt's ``PromptCache`` holds, for each block of the stage, the keys and values of the tokens the
stage has seen (``LayerCache``), and how many tokens that is. ``forward_cached`` feeds the tokens that
follow: the whole prompt once (the prefill), then one token per step (the decode), at positions that go
on from the cache's length. The stage hands on the hidden states of the new tokens, or, when it holds the
head, the logits of the last one: the only ones sampling needs.

The same function serves one process (the whole model as one stage) and every stage of a pipeline, and a
prompt is always computed alone (batch 1), so its arithmetic is the same however the model is cut and
however the prompts are grouped: the text is the same byte for byte.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeclock.models.gpt import Block, Embedding, Head, LayerCache


class PromptCache:
    """The keys and values one prompt left in one stage's blocks, and the number of tokens seen."""

    def __init__(self, pieces: nn.Sequential, seq_len: int):
        self.layers = {
            name: LayerCache(piece.attn, seq_len)
            for name, piece in pieces.named_children()
            if isinstance(piece, Block)
        }
        self.length = 0

    def reset(self) -> None:
        """Forget every token: the next feed starts again at position 0 (a window that slid)."""
        self.length = 0
        for layer in self.layers.values():
            layer.reset()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())


@torch.no_grad()
def forward_cached(pieces: nn.Sequential, inputs: torch.Tensor, cache: PromptCache) -> torch.Tensor:
    """``inputs`` (token ids ``(1, n)`` on the embedding's stage, else hidden states ``(1, n, dim)``) for
    the ``n`` tokens after the ``cache.length`` ones cached -> the hidden states of those tokens, or the
    logits ``(vocab,)`` of the last one on the head's stage. The cache grows by ``n``."""
    start, tokens = cache.length, inputs.shape[1]
    state = None
    for name, piece in pieces.named_children():
        if isinstance(piece, Embedding):
            state = piece(inputs, start)
            continue
        if state is None:
            positions = torch.arange(start, start + tokens, device=inputs.device)[None]
            state = (inputs, positions)
        if isinstance(piece, Block):
            state = piece(state, cache.layers[name])
        elif isinstance(piece, Head):
            hidden, positions = state
            cache.length = start + tokens
            return piece((hidden[:, -1:], positions[:, -1:]))[0, -1].float()
        else:
            raise TypeError(f"a GPT stage holds embed, h<i> and head pieces, not {type(piece).__name__}")
    cache.length = start + tokens
    return state[0]
