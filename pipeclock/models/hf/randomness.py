"""Random numbers in a Hugging Face model that do not depend on how it is cut.

A family draws random numbers in two ways, and each is keyed so that the same sample meets the same
draws at the same layer on one process and on any number of stages:

- an ``nn.Dropout`` module becomes a ``KeyedDropout`` keyed by the module's name (per sample and
  element: independent of the micro-batches too);
- everything else a layer draws from the global generator (``F.dropout`` written as a function call, a
  router's jitter or sampling) is drawn from the generator seeded, for that layer's call, by
  (seed, step, the micro-batch's first sample, the layer): `keyed_randomness`. The base model's own
  calls (dropout after the embeddings) are keyed the same way, as layer -1. The generator's state is put
  back after each call, so nothing else sees a difference.

The one-process reference gets the same keys from `keyed` (what `pipeclock.models.hf.whole` and a
stage do to themselves), so a pipelined step equals ``transformers``' own forward and backward for the
same micro-batches.
"""

from __future__ import annotations

import zlib
from functools import partial

import torch
from torch import nn

from pipeclock.engine import rng
from pipeclock.engine.rng import KeyedDropout

BASE_KEY = -1  # the layer key of what the base model draws outside its layers


def keyed(model: nn.Module, seed: int, layers: nn.ModuleList | None = None, base: nn.Module | None = None):
    """Dropout modules and every other draw of ``model`` keyed (in place); returns ``model``.

    ``layers`` and ``base`` (the decoder layer list and the module holding it) are found from the model
    when not given.
    """
    if layers is None or base is None:
        from pipeclock.models.hf.structure import find_layout

        layout = find_layout(model)
        base = layout.base_of(model)
        layers = getattr(base, layout.layers)
    keyed_dropout(model, seed)
    keyed_randomness(layers, base, seed)
    return model


def keyed_dropout(model: nn.Module, seed: int) -> nn.Module:
    """Every ``nn.Dropout`` of ``model`` becomes a ``KeyedDropout`` keyed by its module name; in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, KeyedDropout(child.p, layer=name_key(full), seed=seed))
    return model


def keyed_randomness(layers: nn.ModuleList, base: nn.Module, seed: int) -> None:
    """Each layer's call (and the base model's) draws from the global generator seeded by its key."""
    for index, layer in enumerate(layers):
        _key_calls(layer, seed, index)
    _key_calls(base, seed, BASE_KEY)


def name_key(name: str) -> int:
    return zlib.crc32(name.encode())


def _key_calls(module: nn.Module, seed: int, layer: int) -> None:
    if getattr(module, "_pipeclock_keyed", False):
        return
    saved: list[tuple] = []
    module.register_forward_pre_hook(partial(_seed_generator, saved, seed, layer))
    module.register_forward_hook(partial(_restore_generator, saved), always_call=True)
    module._pipeclock_keyed = True


def _seed_generator(saved: list, seed: int, layer: int, module: nn.Module, args) -> None:
    position = rng.current()
    saved.append(_generator_states())
    torch.manual_seed(rng.key(seed, position.step, position.first_sample, layer))


def _restore_generator(saved: list, module: nn.Module, args, output) -> None:
    cpu, device = saved.pop()
    torch.set_rng_state(cpu)
    if device is not None:
        torch.cuda.set_rng_state(device)


def _generator_states() -> tuple[torch.Tensor, torch.Tensor | None]:
    device = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), device
