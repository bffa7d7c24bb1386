"""Hugging Face causal language models, unmodified, cut into pipeline stages (``pip install pipeclock[hf]``).

    from pipeclock.models import hf
    chunks = hf.split(LlamaConfig(...), stage=rank, num_stages=world)        # random weights, by name
    chunks = hf.split("path/to/from_pretrained_dir", stage=rank, num_stages=world)
    pipe = schedule.Pipeline(chunks, "1f1b", 8, hf.loss(config))           # HF's labels= loss
    pipe.step((input_ids, attention_mask), labels)
    hf.save_pretrained(chunks, config, "out")                              # every rank; the first writes

A model is ``layers + 2`` pieces (embedding, each decoder layer, final norm with the head), found from
the model itself (`structure`); a rank builds only its own (`build`), and each stage runs the model's own
code around its pieces (`stage`). Parameter names are HF's; a tied head is declared with ``tie``.
Random numbers are keyed so that they do not depend on the cut (`randomness`); a mixture of experts'
auxiliary loss is gathered across stages (`routers`). Which families are exact and which are refused,
and why, is in docs/hf/families.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import nn

from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.models.config_refusals import config_refusals
from pipeclock.models.hf import weights
from pipeclock.models.hf.build import (
    MIN_BYTE_VOCABULARY,
    build_stages,
    meta_model,
    prepared_config,
    remote_code,
    stage_cut,
)
from pipeclock.models.hf.expert_plan import ep_plan
from pipeclock.models.hf.export import save_pretrained
from pipeclock.models.hf.randomness import keyed, keyed_dropout
from pipeclock.models.hf.routers import WithRouterLoss
from pipeclock.models.hf.stage import HFStage
from pipeclock.models.hf.structure import Layout, NotUnderstood, find_layout
from pipeclock.models.hf.tensor_plan import tp_plan
from pipeclock.models.split import PlacementLike, resolve_placement, virtual_stages

__all__ = [
    "MIN_BYTE_VOCABULARY",
    "HFStage",
    "Layout",
    "NotUnderstood",
    "config_of",
    "ep_plan",
    "keyed",
    "keyed_dropout",
    "layout_of",
    "load_weights",
    "loss",
    "save_pretrained",
    "split",
    "tp_plan",
    "whole",
]


def loss(config=None) -> TokenCrossEntropy:
    """HF's ``labels=`` loss: logits at t predict the label at t + 1; -100 is ignored; token mean.

    Given the model's config (or model, or directory) with ``output_router_logits`` set, the routers'
    auxiliary loss is added as the family adds it (``router_aux_loss_coef`` times it, `routers`).
    """
    if config is not None:
        config = config_of(config)
        if getattr(config, "output_router_logits", False):
            return WithRouterLoss(float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))
    return TokenCrossEntropy(shift=True)


def config_of(source, trust_remote_code: bool = False):
    """The config of a config, a model, or a local ``from_pretrained`` directory (or its config.json).

    A directory whose config names its own Python code (``auto_map``) needs ``trust_remote_code``."""
    if isinstance(source, str | Path):
        from transformers import AutoConfig

        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"no Hugging Face config at {path}")
        with remote_code(trust_remote_code, path), config_refusals(path):
            return AutoConfig.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=trust_remote_code
            )
    if isinstance(source, nn.Module):
        return source.config
    return source


def layout_of(source, trust_remote_code: bool = False) -> Layout:
    """Where the embedding, layers, norm and head of ``source``'s model are (built on the meta device)."""
    config = prepared_config(config_of(source, trust_remote_code))
    return find_layout(meta_model(config, trust_remote_code=trust_remote_code))


def split(
    model_or_config,
    stage: int,
    num_stages: int,
    *,
    chunks: int = 1,
    placement: PlacementLike = "loop",
    balance: Sequence | None = None,
    seed: int = 0,
    weights: str | Path | None = None,
    trust_remote_code: bool = False,
) -> HFStage | list[HFStage]:
    """Rank ``stage``'s chunk(s) of a causal LM: one `HFStage` for one chunk, a list for several.

    ``model_or_config``: a ``PretrainedConfig`` (random weights from ``seed`` and each parameter's name),
    a ``PreTrainedModel`` (its config and, from its state, its weights), or a local directory (its config
    and safetensors weights, read by name). ``balance``: the pieces of every virtual stage (ranges or
    sizes), by default balanced by count. Only this rank's pieces are allocated. ``trust_remote_code``
    runs the model's own Python code, for a config that names it (``auto_map``): off by default.
    """
    config = prepared_config(config_of(model_or_config, trust_remote_code))
    if weights is None and isinstance(model_or_config, str | Path) and Path(model_or_config).is_dir():
        weights = model_or_config
    resolved = resolve_placement(placement, num_stages, chunks)
    cls = type(model_or_config) if isinstance(model_or_config, nn.Module) else None
    model = meta_model(config, seed, cls, trust_remote_code)
    layout = find_layout(model)
    cut = stage_cut(layout, resolved.num_virtual, balance)
    mine = virtual_stages(stage, num_stages, chunks, resolved)
    stages = build_stages(model, layout, cut, mine, seed, weights)
    if isinstance(model_or_config, nn.Module):
        _copy_from(model_or_config, stages)
    return stages[0] if len(stages) == 1 else stages


def whole(
    model_or_config, seed: int = 0, weights: str | Path | None = None, trust_remote_code: bool = False
) -> HFStage:
    """The whole model as one stage, built the same way: the one-process reference of every split."""
    result = split(model_or_config, 0, 1, seed=seed, weights=weights, trust_remote_code=trust_remote_code)
    assert isinstance(result, HFStage)
    return result


def load_weights(stages: Sequence[nn.Module], directory: str | Path, trust_remote_code: bool = False) -> None:
    """Copy ``stages``' parameters from a ``from_pretrained`` directory, reading only their tensors,
    converted as ``transformers`` converts them (a mixture of experts' per-expert tensors fused)."""
    config = prepared_config(config_of(directory, trust_remote_code))
    weights.load_weights(stages, directory, meta_model(config, trust_remote_code=trust_remote_code))


def _copy_from(model: nn.Module, stages: list[HFStage]) -> None:
    import torch

    from pipeclock.engine.ties import tie_key

    state = model.state_dict()
    with torch.no_grad():
        for stage in stages:
            for name, parameter in stage.named_parameters():
                parameter.copy_(state[tie_key(parameter) or name])
