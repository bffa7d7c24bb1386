"""The experts' stacked gate-and-up weights on disk: always ``[..., 2, inter, ...]``, the split's layout.

Under tensor parallel each rank holds its slice of the gate and the same slice of the up
(`pipeclock.parallel.tp_experts`), a DTensor of the weight viewed with the halves apart. Saved so at
every tp (a whole weight, at tp 1, through a view of that shape), one checkpoint moves between any tp
sizes by DCP's own resharding, a rank reading only its shards; ``export --hf`` gets ``transformers``'
shape back, as the views write into the model's own weights. A checkpoint written with the whole shape
(before this layout) still loads into a whole weight: a key is viewed only where the checkpoint says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipeclock.parallel.tp_experts import stacked_weights


def held_views(
    modules: Sequence[nn.Module],
    model: dict,
    optim: dict | None = None,
    saved: Callable[[], dict] | None = None,
) -> dict[str, tuple[dict, torch.Tensor]]:
    """Replace, in a state dict (``model``, and ``optim``'s flattened state), each whole stacked weight
    and its optimizer state by a view with the halves apart; ``saved`` (read only where there is such a
    weight: a checkpoint's sizes by key, without the ``model.``/``optim.`` prefix) limits it to the keys
    saved so. Returns what was replaced (key -> its dict and the original), to put back with `restore`."""
    replaced = {}
    stacked = stacked_weights(list(modules))
    sizes = saved() if saved is not None and stacked else None
    for name, weight in stacked.items():
        keys = [(model, name)]
        if optim is not None:
            keys += [(optim, k) for k in optim if k.startswith(f"state.{name}.")]
        for state, key in keys:
            value = state.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() != 3 or hasattr(value, "placements"):
                continue
            view = weight.held(value)
            if sizes is not None and tuple(sizes.get(key, ())) != tuple(view.shape):
                continue
            replaced[key] = (state, value)
            state[key] = view
    return replaced


def restore(replaced: dict[str, tuple[dict, torch.Tensor]]) -> None:
    """Put back what `held_views` replaced (the views wrote into these tensors' storage)."""
    for key, (state, original) in replaced.items():
        state[key] = original
