"""Tensor parallel for a Hugging Face causal LM: the plan ``transformers`` itself applies to the model.

A family declares its plan in its config (``base_model_tp_plan``: the attention projections and the MLP,
the Megatron way) and its CausalLM class (the LM head's split); ``transformers`` merges them, adding the
token embedding split by vocabulary, into the model's ``tp_plan``, named from the CausalLM down
(``model.layers.*.self_attn.q_proj``). A stage (`HFStage`) holds its pieces under those same names, so
the merged plan applies to each rank's share as it is. A family whose config has no plan is refused;
``given`` (a ``--tp-plan`` file, in ``base_model_tp_plan``'s format) stands in for the config's, merged
the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch

from pipeclock.models.hf.build import copy_config, meta_model, prepared_config

# families whose gradients at tp 2 differ from one process's for a reason not yet found: refused
NOT_EXACT = {
    "deepseek_v4": "its routers' gradients differ from one process's at tp 2 (by 100 %, the loss exact), "
    "even with only the embedding and the head split",
}


def tp_plan(config, tp: int, given: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole model's plan (names from the CausalLM down), once ``tp`` is known to split its heads
    (when the plan splits attention: a pattern naming an ``attn`` or ``attention`` module).

    Raises ``ValueError`` for a config without a plan (none given) or heads that ``tp`` does not divide.
    """
    config = prepared_config(config)
    if config.model_type in NOT_EXACT:
        raise ValueError(f"{type(config).__name__} is refused at --tp {tp}: {NOT_EXACT[config.model_type]}")
    if given is not None:
        config = copy_config(config)
        config.base_model_tp_plan = dict(given)
    if not config.base_model_tp_plan:
        raise ValueError(
            f"{type(config).__name__} has no tensor-parallel plan (its base_model_tp_plan is empty): "
            "give one with --tp-plan FILE (a JSON in the same format, "
            '{"layers.*.mlp.up_proj": "colwise", ...})'
        )
    if any("attn" in pattern or "attention" in pattern for pattern in config.base_model_tp_plan):
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for size, what in ((heads, "attention heads"), (kv_heads, "key/value heads")):
            if isinstance(size, int) and size % tp:
                raise ValueError(f"--tp {tp} does not divide the model's {size} {what}")
    model = meta_model(config)
    plan = dict(model.tp_plan) if given is not None else _present(model, dict(model.tp_plan))
    return plan | _per_head_norms(model, config) | _scalar_weights(model)


def _present(model, plan: dict[str, str]) -> dict[str, str]:
    """The family's own plan less the patterns this config's model has nothing for (Qwen3-MoE's plan
    names a dense MLP that only ``mlp_only_layers`` have): a family's plan covers all its variants."""
    names = [n.split(".") for n, _ in [*model.named_modules(), *model.named_parameters()]]

    def found(pattern: str) -> bool:
        parts = pattern.split(".")
        return any(len(n) == len(parts) and all(map(fnmatch, n, parts)) for n in names)

    return {pattern: style for pattern, style in plan.items() if found(pattern)}


def _per_head_norms(model, config) -> dict[str, str]:
    """A norm with a weight per head (``[heads, head_dim]``, Cohere's ``use_qk_norm``) that the plan
    leaves whole, inside an attention it splits: split with its heads (``per_head``), one pattern for
    every layer. Left whole, it would meet a rank's share of the heads with all of theirs."""
    heads = {getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)}
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not name.endswith(("q_norm", "k_norm")) or weight is None or weight.dim() != 2:
            continue
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if weight.shape[0] in heads and pattern not in model.tp_plan:
            found[pattern] = "per_head"
    return found


def _scalar_weights(model) -> dict[str, str]:
    """A module inside a split block whose weights are all scalars (Apertus' learned activation, xIELU),
    which the plan leaves whole: on each rank's slice it works as on the whole, and its gradient is each
    rank's part, to be summed (``replicated_with_grad_allreduce``)."""
    split = [p for p, style in model.tp_plan.items() if style in ("colwise", "rowwise")]
    parents = {p.rsplit(".", 1)[0] for p in split if "." in p}
    found = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if not own or any(p.numel() != 1 for p in own) or pattern in model.tp_plan:
            continue
        if "." in pattern and pattern.rsplit(".", 1)[0] in parents:
            found[pattern] = "replicated_with_grad_allreduce"
    return found
