"""A trained model back in Hugging Face's own format: a ``save_pretrained`` directory.

The names in pipeclock's stages and checkpoints are HF's, so the whole model's state loads into the
unmodified ``*ForCausalLM`` as it is, and ``AutoModelForCausalLM.from_pretrained(OUT)`` reads the
trained weights. From a script, every rank hands its own stages: they are gathered on the first rank,
which writes the directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def save_pretrained(
    model: dict[str, torch.Tensor] | nn.Module | Sequence[nn.Module],
    config,
    output: str | Path,
    group: dist.ProcessGroup | None = None,
    trust_remote_code: bool = False,
) -> Path | None:
    """Write a causal LM with ``config`` as a ``from_pretrained`` directory ``output``.

    ``model`` is the whole model's state (HF names), or this rank's stage or stages (what
    ``pipeclock.models.hf.split`` returned). Under ``torch.distributed`` every rank of ``group`` calls it
    with its own stages: the first rank gathers every rank's tensors and writes (and returns the path);
    the others return None. ``trust_remote_code``: for a model of its own Python code (as it was split).
    """
    state = _state_of(model)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        state = _gathered(state, group)
        if state is None:
            return None
    return _write(state, config, Path(output), trust_remote_code)


def _state_of(model) -> dict[str, torch.Tensor]:
    if isinstance(model, dict):
        return model
    modules = [model] if isinstance(model, nn.Module) else list(model)
    return {name: t.detach() for module in modules for name, t in module.state_dict().items()}


def _gathered(state: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor] | None:
    """Every rank's ``state`` merged on the group's first rank (None on the others)."""
    first = dist.get_global_rank(group, 0) if group is not None else 0
    mine = {name: t.cpu() for name, t in state.items()}
    found = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(mine, found, dst=first, group=group)
    if found is None:
        return None
    return {name: t for part in found for name, t in part.items()}


def _write(state: dict[str, torch.Tensor], config, output: Path, trust_remote_code: bool) -> Path:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from pipeclock.models.hf.build import copy_config

    logging.disable_progress_bar()
    config = copy_config(config)
    config.use_cache = True  # for generation; the pipeline turns it off itself
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model.load_state_dict(state, strict=True, assign=True)
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight and getattr(
        config, "tie_word_embeddings", False
    ):
        model.tie_weights()
    model.save_pretrained(str(output))
    _follow_umask(Path(output))
    return Path(output)


def _follow_umask(directory: Path) -> None:
    """Give every file written the mode any new file gets here (safetensors writes its own 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)
