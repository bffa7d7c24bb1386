"""The attention core without a flash-style kernel: its score matrix, square in the sequence, through memory.

Before FlashAttention (2022), Megatron-LM and DeepSpeed computed ``softmax(q k^T) v`` as two batched
products around a fused scale-mask-softmax and a dropout, each writing or reading the whole
``heads x seq x seq`` score matrix of every sequence. Its bytes grow with ``seq / (head_dim x width)``
against the products' FLOPs: they weigh on narrow models most.
A flash-style kernel keeps the square in on-chip memory, which is what the planner assumes by default
(``Software(attention="flash")``); ``"materialized"`` charges the square's trips as this module says.
"""

from __future__ import annotations

from pipeclock.plan import calibration


def score_seconds(model, config, job, software, rates) -> float:
    """Seconds one layer's forward spends moving its score matrix for one micro-batch (0 with a
    flash-style kernel); the backward moves twice as much, a recompute the forward's again."""
    if software.attention == "flash" or model.kind == "mlp":
        return 0.0
    elements = config.microbatch_size * model.heads / config.tp * job.seq_len**2 / config.cp
    return calibration.SCORE_BYTES * elements / rates.memory
