"""Building a rank's pieces of a Hugging Face causal LM without building the model.

The whole model is created on the meta device (shapes, no memory), its layout read, and only this rank's
pieces are given memory. Initial weights use the family's own ``_init_weights``, each module under a
generator seeded by (seed, the module's name) alone, so any split equals the one-process model built the
same way (`whole`). Weights from a local ``from_pretrained`` directory are read tensor by tensor, by name:
a rank opens the safetensors files but reads only its own tensors.

Random numbers: every ``nn.Dropout`` becomes a ``KeyedDropout`` keyed by its module's name, so dropout
does not depend on the cut. Attention dropout (on attention probabilities, drawn inside the attention
kernel from the global generator) cannot be made exact: it is turned off, with a one-line warning.
"""

from __future__ import annotations

import json
import warnings
import zlib
from collections.abc import Sequence
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

import torch
from torch import nn

from pipeclock.engine.notices import RunWarning
from pipeclock.engine.rng import KeyedDropout
from pipeclock.engine.ties import tie
from pipeclock.models.hf.stage import HFStage
from pipeclock.models.hf.structure import Layout, NotUnderstood, check_causal

ATTENTION_DROPOUT_FIELDS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
MIN_BYTE_VOCABULARY = 256


def prepared_config(config):
    """A copy of ``config`` for pipelined training: no KV cache, attention dropout off (warned)."""
    check_causal(config)
    config = copy_config(config)
    config.use_cache = False
    for field in ATTENTION_DROPOUT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, float | int) and value > 0:
            warnings.warn(
                f"{type(config).__name__}.{field} = {value}: attention dropout cannot be made exact "
                "across stages, so it is turned off (other dropout stays, keyed)",
                RunWarning,
                stacklevel=3,
            )
            setattr(config, field, 0.0)
    return config


def copy_config(config):
    return type(config).from_dict(config.to_dict())


def meta_model(config, seed: int = 0) -> nn.Module:
    """The whole ``*ForCausalLM`` of ``config`` on the meta device: its structure, no memory."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        raise NotUnderstood(
            f"{type(config).__name__} is not a causal language model "
            "(AutoModelForCausalLM has no class for it)"
        ) from None
    return keyed_dropout(model, seed)


def keyed_dropout(model: nn.Module, seed: int) -> nn.Module:
    """Every ``nn.Dropout`` of ``model`` becomes a ``KeyedDropout`` keyed by its module name; in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, KeyedDropout(child.p, layer=_name_key(full), seed=seed))
    return model


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode())


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + _name_key(name)) % (2**63)


@contextmanager
def _cpu_generator_kept():
    """The global CPU generator as it was, after the family's init (which draws from it) has run."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _init_module(model: nn.Module, module: nn.Module, seed: int, name: str) -> None:
    """The family's own init of ``module``, drawing from the CPU generator seeded by (seed, name) alone."""
    torch.default_generator.manual_seed(_module_seed(seed, name))
    with torch.no_grad():
        model._init_weights(module)


def stage_cut(layout: Layout, num_virtual: int, balance: Sequence | None) -> list[range]:
    """The pieces of every virtual stage: balanced by count, or as ``balance`` says (ranges or sizes)."""
    from pipeclock.models.split import partition

    if num_virtual > layout.num_pieces:
        raise ValueError(
            f"a model of {layout.num_layers} layers has {layout.num_pieces} pieces "
            "(embedding, layers, head): "
            f"it cannot be cut into {num_virtual} stages; use at most {layout.num_pieces} stages x chunks"
        )
    if balance is None:
        return partition(layout.num_pieces, num_virtual)
    cut = [b if isinstance(b, range) else None for b in balance]
    if all(c is None for c in cut):
        bounds = [0]
        for size in balance:
            bounds.append(bounds[-1] + int(size))
        cut = [range(a, b) for a, b in pairwise(bounds)]
    if len(cut) != num_virtual or cut[0].start != 0 or cut[-1].stop != layout.num_pieces:
        raise ValueError(
            f"balance must cover the {layout.num_pieces} pieces in {num_virtual} stages, got {balance}"
        )
    return cut


def build_stages(
    model: nn.Module,
    layout: Layout,
    cut: list[range],
    virtual: Sequence[int],
    seed: int = 0,
    weights: str | Path | None = None,
) -> list[HFStage]:
    """The stages ``virtual`` of the meta ``model`` cut by ``cut``, with memory for their pieces only."""
    keep = [
        n for n, c in getattr(model, layout.base).named_children() if not any(True for _ in c.parameters())
    ]
    stages = [HFStage(model, layout, cut[v], keep) for v in virtual]
    with _cpu_generator_kept():
        for stage in stages:
            _materialize(stage, model, seed)
        _tie(stages, model, layout, seed)
    if weights is not None:
        load_weights(stages, weights)
    return stages


def _materialize(stage: HFStage, model: nn.Module, seed: int) -> None:
    """Give the stage's meta tensors memory and the family's initial values, each module from its name."""
    modules = list(stage.named_modules())
    for _, module in modules:
        if _has_meta(module):
            module.to_empty(device="cpu", recurse=False)
    for name, module in reversed(modules):  # children before parents, as nn.Module.apply
        if name and not _is_bare_container(module):
            _init_module(model, module, seed, name)


def _has_meta(module: nn.Module) -> bool:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.is_meta for t in tensors)


def _is_bare_container(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList | nn.ModuleDict)


def _tie(stages: list[HFStage], model: nn.Module, layout: Layout, seed: int) -> None:
    """The head's weight is the embedding's: the same tensor on one rank, a marked copy elsewhere."""
    if not layout.tied:
        return
    key = layout.embedding_weight()
    embedding = next((getattr(s._base(), layout.input_embedding) for s in stages if s.has_embedding), None)
    head = next((getattr(s, layout.head) for s in stages if s.has_head), None)
    if embedding is not None:
        tie(embedding.weight, key)
    if head is None:
        return
    if embedding is not None:
        head.weight = embedding.weight
        return
    source = getattr(getattr(model, layout.base), layout.input_embedding)
    source.to_empty(device="cpu", recurse=False)
    _init_module(model, source, seed, f"{layout.base}.{layout.input_embedding}")
    head.weight = tie(nn.Parameter(source.weight.detach().clone()), key)
    source.to_empty(device="meta", recurse=False)


# --- weights from a local from_pretrained directory ----------------------------------------------------


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


def load_weights(stages: Sequence[nn.Module], directory: str | Path) -> None:
    """Copy each of the stages' parameters from the directory's safetensors, reading only those tensors."""
    from safetensors import safe_open

    from pipeclock.engine.ties import tie_key

    files = weight_files(Path(directory))
    wanted: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for stage in stages:
        for name, parameter in stage.named_parameters():
            stored = _stored_name(tie_key(parameter) or name, files, directory)
            wanted.setdefault(files[stored], []).append((stored, parameter))
    with torch.no_grad():
        for file, tensors in wanted.items():
            with safe_open(str(file), "pt") as handle:
                for stored, parameter in tensors:
                    parameter.copy_(handle.get_tensor(stored))


def _stored_name(name: str, files: dict[str, Path], directory) -> str:
    """The name a checkpoint stores a parameter under (older files drop the base model's prefix)."""
    if name in files:
        return name
    bare = name.split(".", 1)[1] if "." in name else name
    if bare in files:
        return bare
    raise KeyError(f"{directory} has no tensor {name}")
