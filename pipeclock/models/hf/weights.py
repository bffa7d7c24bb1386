"""Weights from a local ``from_pretrained`` directory, read tensor by tensor and converted as
``transformers`` converts them.

What a ``save_pretrained`` directory stores is not always what the model holds: ``transformers`` 5 keeps
a mixture of experts' weights fused in memory (``experts.gate_up_proj``, one tensor for all experts)
and writes them per expert on disk (``experts.0.w1.weight`` ...); older checkpoints drop the base
model's prefix or use older names. Its loader maps every stored name to the model's, with the family's
own conversions (``get_model_conversion_mapping``: renamings, and converters that merge or split
tensors). `load_weights` runs the same machinery for the names a rank holds only: a rank opens the
safetensors files, finds which stored tensors make its parameters, reads just those, and lets the
family's converters fuse them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch
from torch import nn


def weight_files(directory: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor name (the index's map, or every name of the one file)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in mapping.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{directory} holds no weights (model.safetensors or model.safetensors.index.json)"
        )
    from safetensors import safe_open

    with safe_open(str(single), "pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def load_weights(stages: Sequence[nn.Module], directory: str | Path, model: nn.Module) -> None:
    """Copy each of the stages' parameters from the directory's safetensors, reading only the tensors
    they are made of. ``model``: the whole model on the meta device, whose family says how stored
    names and tensors become its own."""
    from safetensors import safe_open

    from pipeclock.engine.ties import tie_key

    directory = Path(directory)
    files = weight_files(directory)
    targets: dict[str, list[torch.Tensor]] = {}
    for stage in stages:
        for name, parameter in stage.named_parameters():
            targets.setdefault(tie_key(parameter) or name, []).append(parameter)
    with ExitStack() as files_open, torch.no_grad():
        handles = {file: files_open.enter_context(safe_open(str(file), "pt")) for file in set(files.values())}
        read = {name: partial(handles[file].get_tensor, name) for name, file in files.items()}
        loaded = _converted(model, read, set(targets))
        for name, tensor in loaded.items():
            for parameter in targets[name]:
                parameter.copy_(tensor)
    missing = sorted(set(targets) - set(loaded))
    if missing:
        raise KeyError(f"{directory} has no tensor {missing[0]}")


def _converted(model: nn.Module, read: dict, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The tensors named ``wanted`` (the model's names), made from the stored ones ``read`` gives (a
    loader per stored name) by the family's renamings and converters."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    names = model.state_dict()  # on the meta device: names and shapes only
    prefix = getattr(model, "base_model_prefix", None)
    plan: dict[str, object] = {}
    for stored in sorted(read, key=dot_natural_key):
        name, pattern = rename_source_key(stored, renamings, converters, prefix, names)
        if name not in names and stored in names:
            name, pattern = stored, None
        if pattern is None:
            if name in wanted:
                transform = plan.setdefault(name, WeightRenaming(stored, name))
                transform.add_tensor(name, stored, stored, read[stored])
            continue
        converter = by_pattern[pattern]
        made = [name.replace(converter.target_patterns[0], t) for t in converter.target_patterns]
        if any(m in wanted for m in made):
            plan.setdefault(name, copy.deepcopy(converter)).add_tensor(name, stored, pattern, read[stored])
    found = {}
    for first, transform in plan.items():
        for name, tensor in transform.convert(first, model=model, config=model.config).items():
            if name in wanted:
                found[name] = tensor[0] if isinstance(tensor, list) else tensor
    return found
