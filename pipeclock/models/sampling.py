"""Sampling text from a trained GPT on one process: one byte at a time, from the model's own distribution."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: torch.Tensor,
    tokens: int,
    seq_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> torch.Tensor:
    """``prompt`` (1-D token ids) followed by ``tokens`` sampled ids.

    The model sees at most its last ``seq_len`` tokens; ``temperature`` 0 takes the most likely token,
    ``top_k`` > 0 samples among the k most likely only. Random draws come from a generator seeded with
    ``seed``, so the same checkpoint, prompt and seed give the same text.
    """
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = prompt.clone()
    for _ in range(tokens):
        logits = model(ids[-seq_len:][None])[0, -1].float()
        ids = torch.cat([ids, _choose(logits, temperature, top_k, generator)])
    return ids


def _choose(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax().reshape(1)
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)
