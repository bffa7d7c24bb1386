"""Expert parallel for a Hugging Face mixture of experts: the plan ``transformers`` itself describes.

A family declares which modules hold its experts in its config (``base_model_ep_plan``: the fused expert
weights ``grouped_gemm``, their container ``ep_dispatch_experts``); ``transformers`` names it from the
CausalLM down (``model.layers.*.mlp.experts``) in the model's ``ep_plan``, the names a stage holds its
pieces under. ``given`` (an ``--ep-plan`` file, in ``base_model_ep_plan``'s format) replaces the config's.
A dense model, or a mixture of experts without a plan (none given), is refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeclock.models.hf.build import copy_config, meta_model, prepared_config

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_count(config) -> int | None:
    """How many experts each MoE layer of ``config`` has; None for a dense model."""
    for name in EXPERT_COUNTS:
        count = getattr(config, name, None)
        if isinstance(count, int) and count > 0:
            return count
    return None


def ep_plan(config, ep: int, given: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole model's ep plan (names from the CausalLM down), once ``ep`` is known to divide its experts.

    Raises ``ValueError`` for a dense model, a plan-less one (none given), or experts ``ep`` does not divide.
    """
    config = prepared_config(config)
    name, count = type(config).__name__, expert_count(config)
    if count is None:
        raise ValueError(f"--ep {ep}: {name} is a dense model (no experts to divide over ranks)")
    if count % ep:
        raise ValueError(f"--ep {ep} does not divide the model's {count} experts")
    if given is not None:
        config = copy_config(config)
        config.base_model_ep_plan = dict(given)
    if not getattr(config, "base_model_ep_plan", None):
        raise ValueError(
            f"{name} has no expert-parallel plan (its base_model_ep_plan is empty): give one with --ep-plan "
            'FILE (a JSON in the same format, {"layers.*.mlp.experts": "ep_dispatch_experts", ...})'
        )
    return dict(meta_model(config).ep_plan)
