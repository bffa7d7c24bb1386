"""Building a rank's pieces of a Hugging Face causal LM without building the model.

The whole model is created on the meta device (shapes, no memory), its layout read, and only this rank's
pieces are given memory. Initial weights use the family's own ``_init_weights``, each module under a
generator seeded by (seed, the module's name) alone, so any split equals the one-process model built the
same way (`whole`). Weights from a local ``from_pretrained`` directory are read tensor by tensor, by name:
a rank opens the safetensors files but reads only its own tensors.

Tensors the family's ``_init_weights`` leaves alone (a constant a module's constructor sets, as Apertus's
activation does for its ``beta``) are found (they are NaN after it ran) and copied from the piece built
again, alone, by its constructor: the values ``transformers`` gives when it builds the model for real.

Random numbers are keyed by (seed, step, sample, layer) (`randomness`), so they do not depend on the
cut: attention dropout too, drawn inside the attention kernel from the generator each layer's call
seeds.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from itertools import pairwise
from pathlib import Path

import torch
from torch import nn

from pipeclock.engine.notices import RunWarning
from pipeclock.engine.ties import tie
from pipeclock.models.hf.randomness import keyed, name_key
from pipeclock.models.hf.refused import refuse_known
from pipeclock.models.hf.routers import RouterLogits
from pipeclock.models.hf.stage import HFStage
from pipeclock.models.hf.structure import Layout, NotUnderstood, check_causal
from pipeclock.models.hf.weights import load_weights

MIN_BYTE_VOCABULARY = 256


def prepared_config(config):
    """A copy of ``config`` for pipelined training: no KV cache, float32 master weights.

    The config of an encoder-decoder family (BART, Whisper ...) becomes what ``AutoModelForCausalLM``
    makes of it: its decoder alone, a causal LM (refused when the family has none)."""
    refuse_known(config)
    check_causal(config)
    config = copy_config(config)
    _train_in_float32(config)
    if getattr(config, "is_encoder_decoder", False):
        config = copy_config(_causal_lm(config).config)
    config.use_cache = False
    return config


def _train_in_float32(config) -> None:
    """Weights stored in another dtype (a bfloat16 checkpoint) are trained as float32 master weights,
    as ``--dtype fp32`` says, and the conversion is said (``--dtype bf16`` computes in bfloat16 over
    them)."""
    stored = getattr(config, "dtype", None)
    name = str(stored).removeprefix("torch.") if stored is not None else "float32"
    if name != "float32":
        warnings.warn(
            f"{type(config).__name__}: weights stored as {name} are trained as float32 master weights "
            "(--dtype bf16 computes in bfloat16 over them)",
            RunWarning,
            stacklevel=4,
        )
    config.dtype = torch.float32


def copy_config(config):
    return type(config).from_dict(config.to_dict())


def meta_model(config, seed: int = 0, cls: type | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The whole ``*ForCausalLM`` of ``config`` on the meta device: its structure, no memory. ``cls``:
    the model's class (that of a model given), else the one ``AutoModelForCausalLM`` picks."""
    return keyed(_causal_lm(config, cls, trust_remote_code), seed)


@contextmanager
def remote_code(trusted: bool, where) -> Iterator[None]:
    """Around loading a model's own Python code: said when trusted, one line refusing it when not."""
    if trusted:
        warnings.warn(
            f"trust_remote_code: running the model's own Python code from {where}; "
            "use it only with code you have read or trust",
            RunWarning,
            stacklevel=4,
        )
    try:
        yield
    except ValueError as error:
        if trusted or "trust_remote_code" not in str(error):
            raise
        raise NotUnderstood(
            f"{where} holds the model's own Python code (auto_map): pass trust_remote_code=True "
            "(train --trust-remote-code) to run it, if you trust it"
        ) from None


def _causal_lm(config, cls: type | None = None, trust_remote_code: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            if cls is not None:
                return cls._from_config(config, dtype=torch.float32)
            with nullcontext() if trust_remote_code else remote_code(False, type(config).__name__):
                return AutoModelForCausalLM.from_config(
                    config, dtype=torch.float32, trust_remote_code=trust_remote_code
                )
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        if getattr(config, "is_encoder_decoder", False):
            raise NotUnderstood(
                f"{type(config).__name__} describes an encoder-decoder model without a causal LM of its "
                "decoder: pipeclock.models.hf splits decoder-only causal language models"
            ) from None
        raise NotUnderstood(
            f"{type(config).__name__} is not a causal language model "
            "(AutoModelForCausalLM has no class for it)"
        ) from None


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + name_key(name)) % (2**63)


@contextmanager
def _cpu_generator_kept():
    """The global CPU generator as it was, after the family's init (which draws from it) has run."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _init_module(model: nn.Module, module: nn.Module, seed: int, name: str) -> None:
    """The family's own init of ``module``, drawing from the CPU generator seeded by (seed, name) alone:
    the ``_init_weights`` of the innermost pretrained model holding it, as ``transformers`` dispatches."""
    torch.default_generator.manual_seed(_module_seed(seed, name))
    owner = model
    parts = name.split(".")
    for depth in range(1, len(parts)):
        inner = model.get_submodule(".".join(parts[:depth]))
        if callable(getattr(inner, "_init_weights", None)) and hasattr(inner, "config"):
            owner = inner
    with torch.no_grad():
        owner._init_weights(module)


def stage_cut(layout: Layout, num_virtual: int, balance: Sequence | None) -> list[range]:
    """The pieces of every virtual stage: balanced by count, or as ``balance`` says (ranges or sizes)."""
    from pipeclock.models.partition import partition

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
    routers = RouterLogits(getattr(model, layout.base.split(".")[0]), model.config)
    stages = [HFStage(model, layout, cut[v], routers) for v in virtual]
    with _cpu_generator_kept():
        for stage in stages:
            _materialize(stage, model, seed)
        _tie(stages, model, layout, seed)
    if weights is not None:
        load_weights(stages, weights, model)
    return stages


def _materialize(stage: HFStage, model: nn.Module, seed: int) -> None:
    """Give the stage's meta tensors memory and the family's initial values, each module from its name."""
    modules = list(stage.named_modules())
    shared = _shared_parameters(stage)
    for _, module in modules:
        if _has_meta(module):
            module.to_empty(device="cpu", recurse=False)
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if tensor.is_floating_point():
                    tensor.data.fill_(float("nan"))  # what the family's init leaves alone stays NaN
    for name, module in reversed(modules):  # children before parents, as nn.Module.apply
        if name and not _is_bare_container(module):
            _init_module(model, module, seed, name)
    for first, *others in shared:  # one parameter in two places (BERT's decoder bias): one again
        for module, name in others:
            setattr(module, name, getattr(first[0], first[1]))
    _constructed_values(stage, model)


def _shared_parameters(stage: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Where each parameter held in more than one place is held: (module, attribute) lists."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in stage.named_modules(remove_duplicate=False):
        for name, parameter in module._parameters.items():
            if parameter is not None and (module, name) not in places.get(id(parameter), []):
                places.setdefault(id(parameter), []).append((module, name))
    return [where for where in places.values() if len(where) > 1]


def _constructed_values(stage: HFStage, model: nn.Module) -> None:
    """Tensors the family's init did not set (NaN, or not floating) take what the model's construction
    gives them: their decoder layer built again alone on the CPU (one at a time), or their own module;
    else the model built with one layer, where that module (or layer 0) sits."""
    small = _OneLayerModel(model, stage.layout)
    layers = stage._held_layers()
    in_layers = set()
    for index, layer in layers.items():
        unset = [name for name, t in _tensors(layer) if _unset(t)]
        in_layers.update(id(t) for _, t in _tensors(layer))
        if unset:
            built = _construct(type(layer), model.config, int(index)) or small.layer()
            _copy(layer, built, unset, f"{type(layer).__name__} {index}")
    for path, module in stage.named_modules():
        own = [(n, t) for n, t in _tensors(module, recurse=False) if id(t) not in in_layers]
        unset = [n for n, t in own if _unset(t)]
        if unset:  # a constant the model's own modules compute (a mask, a scale)
            built = _construct(type(module), small.config, None) or small.module(path)
            _copy(module, built, unset, type(module).__name__, recurse=False)


class _OneLayerModel:
    """The whole model with one decoder layer, built on the CPU once asked for (its constructor's
    values for a module that cannot be built alone)."""

    def __init__(self, model: nn.Module, layout: Layout):
        self.config, self.cls, self.layout, self.built = copy_config(model.config), type(model), layout, None
        if isinstance(getattr(self.config, "num_hidden_layers", None), int):
            with contextlib.suppress(Exception):  # a family may refuse it (ProphetNet)
                self.config.num_hidden_layers = 1

    def _model(self) -> nn.Module | None:
        if self.built is None:
            try:
                with torch.device("cpu"):
                    self.built = self.cls._from_config(self.config, dtype=torch.float32)
            except Exception:
                return None
        return self.built

    def layer(self) -> nn.Module | None:
        model = self._model()
        return None if model is None else getattr(self.layout.base_of(model), self.layout.layers)[0]

    def module(self, path: str) -> nn.Module | None:
        model = self._model()
        try:
            return None if model is None else model.get_submodule(path)
        except AttributeError:
            return None


def _unset(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or bool(tensor.isnan().any())


def _tensors(module: nn.Module, recurse: bool = True) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)]


def _copy(module: nn.Module, built: nn.Module | None, names: list[str], where: str, recurse=True) -> None:
    found = dict(_tensors(built)) if built is not None else {}
    own = dict(_tensors(module, recurse=recurse))
    missing = [n for n in names if n not in found or found[n].shape != own[n].shape]
    if missing:
        raise NotUnderstood(
            f"{where}: {', '.join(missing)} set neither by the family's _init_weights nor by "
            "building the module again"
        )
    with torch.no_grad():
        for name in names:
            own[name].copy_(found[name])


def _construct(cls: type, config, index: int | None) -> nn.Module | None:
    """``cls`` built on the CPU the ways a model builds its modules: (config, layer_idx), (config)."""
    tries = [((config,), {"layer_idx": index}), ((config, index), {})] if index is not None else []
    tries += [((config,), {}), ((), {"config": config})]
    for args, kwargs in tries:
        try:
            with torch.device("cpu"):
                return cls(*args, **kwargs)
        except (TypeError, AttributeError, ValueError):
            continue
    return None


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
    embedding = next((s.get_submodule(layout.input_embedding) for s in stages if s.has_embedding), None)
    head = next((s.get_submodule(layout.head) for s in stages if s.has_head), None)
    if embedding is not None:
        tie(embedding.weight, key)
    if head is None:
        return
    if embedding is not None:
        head.weight = embedding.weight
        return
    source = model.get_submodule(layout.input_embedding)
    source.to_empty(device="cpu", recurse=False)
    _init_module(model, source, seed, layout.input_embedding)
    head.weight = tie(nn.Parameter(source.weight.detach().clone()), key)
    source.to_empty(device="meta", recurse=False)
