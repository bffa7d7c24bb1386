"""What a full recompute leaves out when it stops early: the block's last product and its collective.

A dense transformer block's backward reads its tensors up to the last product's input (the MLP's down
projection keeps it for its weight gradient). That product's output, the tensor-parallel collective
after it (the all-reduce, or under sequence parallel the reduce-scatter) and the residual add feed only
the block's output, which the backward never reads. torch's non-reentrant checkpoint stops recomputing
once it has rebuilt every tensor the backward needs (``torch.utils.checkpoint.set_checkpoint_early_stop``,
on by default), and torch.compile's partitioner recomputes only what the backward reads; torchtitan
wraps each block in ``ptd_checkpoint_wrapper`` (non-reentrant by default), so its full recompute runs
neither (``Software.recompute_stops_early``). Megatron-LM's and DeepSpeed's checkpoint functions run the
whole forward again. A mixture of experts is left whole here (its tail has the combine's exchange too).
"""

from __future__ import annotations


def skipped_seconds(model, each: list, collective: float, config, software) -> float:
    """Seconds a full recompute of one block does not run again: the last of ``each`` (the layer's
    (product, seconds) in the order it runs them), and of ``collective`` (one half-block's exposed
    collectives) the share after that product: the whole all-reduce, or under sequence parallel the
    reduce-scatter's bytes beside the all-gather's (in float8 under fp8: one byte to its two)."""
    if not software.recompute_stops_early or model.kind == "mlp" or model.is_moe or not each:
        return 0.0
    gathered = 1.0 if software.dtype == "fp8" else 2.0  # bytes an all-gathered element carries
    share = 2.0 / (2.0 + gathered) if config.sequence_parallel else 1.0
    return each[-1][1] + share * collective
