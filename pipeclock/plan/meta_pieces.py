"""A Hugging Face model's parameters per piece, counted on the meta device.

The fit check before step 1 reads a model's sizes on paper (``hf_paper.paper_model``), which knows the
families whose shapes it was checked on; any other family is refused there, and a run of it would
otherwise start with no estimate at all, to be ended by the out-of-memory killer without a word. Here
the model itself is built on the meta device (its structure, no memory) and its parameters are counted
piece by piece, as the stages cut it: the embedding (what runs before the layers), each decoder layer,
and the head (what runs after them and the output embedding, counted even when tied to the input's).
"""

from __future__ import annotations

from functools import lru_cache

from torch import nn


def piece_parameters(model: nn.Module, layout) -> list[int]:
    """Parameters of the embedding, each decoder layer and the head of ``model`` under ``layout``."""
    base = layout.base_of(model)
    layers = getattr(base, layout.layers)
    counted = [_count(layer) for layer in layers]
    embedding = sum(_count_path(model, path) for path in layout.embeddings)
    head = sum(_count_path(model, path) for path in (*layout.after, layout.head))
    return [embedding, *counted, head]


def tied_parameters(model: nn.Module, layout) -> int:
    """The parameters the input and output embeddings share (0 when the head has its own matrix)."""
    return _count_path(model, layout.head) if layout.tied else 0


@lru_cache(maxsize=4)
def counted(source: str, trust_remote_code: bool = False) -> tuple[tuple[int, ...], int]:
    """(parameters per piece, tied parameters) of the causal LM of ``source``, a config or model folder."""
    from pipeclock.models.hf import config_of, meta_model, prepared_config
    from pipeclock.models.hf.structure import find_layout

    config = prepared_config(config_of(source, trust_remote_code))
    model = meta_model(config, trust_remote_code=trust_remote_code)
    layout = find_layout(model)
    return tuple(piece_parameters(model, layout)), tied_parameters(model, layout)


def _count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _count_path(model: nn.Module, path: str) -> int:
    """The parameters of the module (or the single parameter) at the dotted ``path``."""
    owner, _, name = path.rpartition(".")
    parent = model.get_submodule(owner) if owner else model
    found = getattr(parent, name)
    return found.numel() if isinstance(found, nn.Parameter) else _count(found)
