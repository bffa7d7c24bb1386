"""Choosing each next byte, and the one-process reference generation, with or without a key/value cache.

Three rules fix the text, wherever it is computed:

- **The random numbers are keyed.** The draw for the byte at ``position`` of prompt ``prompt_index``
  comes from a generator seeded with (seed, prompt index, position) alone (``uniform_for``), never from
  a generator shared by everything before it: prompts computed in another order, in other groups or on
  other ranks meet the same numbers. The byte is read off the cumulative distribution at that number.
- **The window slides by halves.** The model sees at most its context (``seq_len`` bytes). When one
  more byte would not fit, the view restarts at the last ``seq_len // 2`` bytes (``window_start``):
  with a cache, those are computed again once (a prefill), and each byte after is one position again.
- **Temperature 0 is greedy**: the likeliest byte, no draw (as is a temperature so small that the
  scaled logits overflow: greedy is its limit).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeclock.models.decoding import PromptCache, forward_cached

_KEY_MULTIPLIERS = (1_000_003, 998_244_353)


def uniform_for(seed: int, prompt_index: int, position: int) -> float:
    """A number in [0, 1) that depends on (seed, prompt index, position) alone."""
    key = (seed * _KEY_MULTIPLIERS[0] + prompt_index) * _KEY_MULTIPLIERS[1] + position
    generator = torch.Generator().manual_seed(key % (2**63))
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def choose(logits: torch.Tensor, temperature: float, top_k: int, draw: float) -> int:
    """The next byte from ``logits`` (vocab,): the likeliest at temperature 0, else the byte where the
    cumulative distribution (of the ``top_k`` likeliest when ``top_k`` > 0) passes ``draw``."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.double() / temperature
    if not torch.isfinite(logits.max()):  # so small a temperature overflows: its limit, the likeliest
        return int(logits.argmax())
    if 0 < top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    cumulative = logits.softmax(-1).cumsum(-1)
    index = int(
        torch.searchsorted(
            cumulative, torch.tensor([draw * float(cumulative[-1])], dtype=torch.float64), right=True
        )
    )
    return min(index, logits.numel() - 1)


def window_start(length: int, start: int, seq_len: int) -> int:
    """Where the model's view of ``length`` bytes begins, given that it began at ``start``: it stays
    while the view fits the context, and moves to the last ``seq_len // 2`` bytes when it does not."""
    return start if length - start <= seq_len else length - max(1, seq_len // 2)


@torch.no_grad()
def sample(
    model: nn.Sequential,
    prompt: torch.Tensor,
    tokens: int,
    seq_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    prompt_index: int = 0,
    cache: bool = True,
) -> torch.Tensor:
    """``prompt`` (1-D byte ids) followed by ``tokens`` generated ids, on one process.

    ``cache=False`` runs the whole window through the model for every byte (the plain way, whose work
    grows with the context); ``cache=True`` keeps each block's keys and values and feeds one byte per
    step. Both see the same windows and the same draws, so they give the same text.
    """
    model.eval()
    ids, start = prompt.tolist(), 0
    kv = PromptCache(model, seq_len) if cache else None
    for _ in range(tokens):
        moved = window_start(len(ids), start, seq_len)
        if kv is None:
            logits = model(torch.tensor(ids[moved:])[None])[0, -1].float()
        else:
            if moved != start or kv.length == 0:
                kv.reset()
            logits = forward_cached(model, torch.tensor(ids[moved + kv.length :])[None], kv)
        start = moved
        draw = uniform_for(seed, prompt_index, len(ids)) if temperature else 0.0
        ids.append(choose(logits, temperature, top_k, draw))
    return torch.tensor(ids, dtype=torch.int64)
