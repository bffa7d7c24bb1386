"""``--ep`` and ``--ep-plan`` checked before anything starts: what expert parallel can and cannot join.

The model's own checks (a dense model, experts that ep does not divide, a plan naming modules the model
lacks) need the model and come when the stage is built, on every rank alike, still before the first step.
"""

from __future__ import annotations


def check_expert_parallel(config) -> None:
    """``ValueError`` (one line naming the flags) for the first way ``--ep`` cannot work with the rest."""
    ep = config.ep
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be a whole number >= 1, got {ep!r}")
    if config.ep_plan is not None and ep == 1:
        raise ValueError(
            f"--ep-plan {config.ep_plan} needs --ep N with N > 1 (the ranks that divide the experts)"
        )
    if ep == 1:
        return
    if config.model != "hf":
        raise ValueError(
            f"--ep {ep} divides the experts of a Hugging Face mixture of experts (--model hf): "
            f"--model {config.model} has none"
        )
    if config.dp % ep:
        raise ValueError(
            f"--ep {ep} does not divide --dp {config.dp}: the expert groups are carved from a stage's "
            "data-parallel ranks (use a --dp that is a multiple of --ep)"
        )
    if config.tp > 1:
        raise ValueError(
            f"--ep {ep} with --tp {config.tp}: the ranks of a tp group share one batch, whose tokens expert "
            "parallel would send twice; use ep or tp"
        )
    if config.data_parallel != "fsdp":
        raise ValueError(
            f"--ep {ep} takes --data-parallel fsdp (DDP cannot leave the experts out of its sums)"
        )
