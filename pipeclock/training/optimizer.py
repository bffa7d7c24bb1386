"""The optimizer a run steps: torch's Adam or AdamW, weight decay on the matrices only.

Weight decay shrinks the weights that multiply activations (matrices, and embeddings, which are
matrices read by index): every parameter with two or more dimensions. Biases and norm weights, one
dimension each, are left alone, as nanoGPT and torchtitan do; a Hugging Face model is split by the same
rule. The test is a tensor's own ``ndim``, which a DTensor (a tensor-parallel or FSDP2 shard) reports for
the whole tensor, so every layout puts each weight in the same group. A weight two chunks of one rank
share (a tie) is one parameter, in one group, counted once.

``--weight-decay`` needs ``--optimizer adamw``: on torch's Adam it would be an L2 penalty added to the
gradient, and so scaled by Adam's normalisation, which is not what the flag promises (``check_optimizer``
refuses it). The update runs torch's fused kernel where the device has one (CPU and CUDA here), else
its foreach one: the same arithmetic as the plain loop, element for element, at a fraction of the time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# The device kinds torch's fused Adam and AdamW kernels run on (torch.optim's documented list, less the
# accelerators pipeclock does not drive); elsewhere the foreach kernels.
FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu")


def parameter_groups(parameters: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """The parameters in torch's group format: those with ndim >= 2 decayed by ``weight_decay``, the
    others not at all. One group when nothing decays; an empty group is left out.

    Under tensor parallel a stage holds both DTensors (its split layers) and plain tensors (the layers
    left whole), and one fused or foreach call cannot take both: each kind gets groups of its own,
    with the same settings, so the arithmetic is unchanged.
    """
    distinct = list({id(p): p for p in parameters}.values())
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for parameter in distinct:
        decays = weight_decay > 0 and parameter.ndim >= 2
        groups.setdefault((decays, isinstance(parameter, DTensor)), []).append(parameter)
    return [
        {"params": params, "weight_decay": weight_decay if decays else 0.0}
        for (decays, _), params in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1]))
    ]


def build_optimizer(config, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``config.optimizer`` (``adam`` or ``adamw``) over ``parameters`` with the run's lr, betas, eps and
    decay groups; fused where torch has a fused kernel for the parameters' device, else foreach."""
    groups = parameter_groups(parameters, config.weight_decay)
    make = OPTIMIZERS[config.optimizer]
    settings = dict(lr=config.lr, betas=tuple(config.betas), eps=config.eps)
    devices = {p.device.type for group in groups for p in group["params"]}
    fused = devices <= set(FUSED_DEVICES)
    return make(groups, **settings, **({"fused": True} if fused else {"foreach": True}))


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's hyperparameters (everything but its parameters), to put back over a checkpoint's."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> None:
    """The run's own hyperparameters over those a loaded optimizer state brought back: the flags win."""
    for group, mine in zip(optimizer.param_groups, settings, strict=True):
        group.update(mine)


def check_optimizer(config) -> None:
    """``ValueError`` naming the flag for an optimizer setting that cannot work."""
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be {' or '.join(OPTIMIZERS)}, got {config.optimizer!r}")
    betas = tuple(config.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        shown = ",".join(f"{b:g}" for b in betas)
        raise ValueError(f"--betas must be two numbers B1,B2 each in [0, 1), got {shown}")
    if not config.eps > 0:
        raise ValueError(f"--eps must be > 0, got {config.eps}")
    if not config.weight_decay >= 0:
        raise ValueError(f"--weight-decay must be >= 0, got {config.weight_decay}")
    if config.weight_decay > 0 and config.optimizer == "adam":
        raise ValueError(
            f"--weight-decay {config.weight_decay} needs --optimizer adamw (decoupled weight decay); "
            "on adam it would be an L2 penalty scaled by Adam's normalisation"
        )


def parse_betas(text: str) -> tuple[float, float]:
    """``"0.9,0.95"`` as ``(0.9, 0.95)``; ``ValueError`` for anything but two numbers."""
    parts = text.split(",")
    try:
        betas = tuple(float(part) for part in parts)
    except ValueError:
        betas = ()
    if len(betas) != 2:
        raise ValueError(f"--betas must be two numbers B1,B2 (e.g. 0.9,0.95), got {text!r}")
    return betas
