"""The cluster planner's calibration constants: the few figures that no datasheet gives.

Each is named in docs/cluster.md with the published runs it was fitted on and the ones it was checked
against (``python -m benchmarks.cluster_check`` refits and rechecks them).
"""

from __future__ import annotations

# Share of the dense peak that a large matrix product reaches (its operands' trips through memory are
# charged on top, at the memory's bandwidth): a GPU kind's own figure. Fitted on Megatron-LM's H100 runs
# and on published A100 runs (docs/cluster.md names them); the kinds without published runs take the H100's.
H100_GEMM_EFFICIENCY = 0.582
A100_GEMM_EFFICIENCY = 0.600
GEMM_EFFICIENCY = H100_GEMM_EFFICIENCY
# The attention kernel's speed (flash-style, causal: only the unmasked half) as a share of the products'.
ATTENTION_SHARE = 0.552
# Bytes moved per element of the attention's score matrix in a forward without a flash-style kernel
# (written by q k^T, read and written by softmax and by dropout with its mask, read by the product with v).
SCORE_BYTES = 13.0
# Elementwise work (norms, activation functions, residuals, rotary), in bytes moved through memory per
# byte a layer keeps for its backward: eager PyTorch runs each operation alone, fused kernels (or
# torch.compile) run a few. The backward moves twice the forward's.
ELEMENTWISE_PASSES = {"eager": 2.24, "fused": 0.689}
# Bytes a logit moves through memory in the loss (bf16 logits, an fp32 softmax cross-entropy), forward and
# backward, at the memory's datasheet bandwidth. Measured, not fitted: Megatron-LM's unfused
# vocab_parallel_cross_entropy on an H100 SXM, 8,192 tokens of 131,072 logits, 15.81 ms forward and
# 21.25 ms with its backward (docs/cluster.md gives the source).
LOSS_BYTES = {"forward": 49.3, "backward": 17.0}
# float8 products' share of the fp8 peak, as a share of what bf16 products reach of theirs (the scaling
# and casts around each product included).
FP8_SHARE = 0.749
H100_FP8_GEMM_EFFICIENCY = 0.60  # an H100 SXM's own: float8 products' share of its fp8 dense peak
# Share of a link's bandwidth that a collective or a message reaches, and the fixed cost of each.
LINK_EFFICIENCY = 0.80
COLLECTIVE_LATENCY = 20e-6  # seconds
# Share of tensor parallel's collectives hidden behind the products when the run overlaps them.
TP_OVERLAP_HIDDEN = 0.7
# Memory the allocator reserves beyond what is allocated, as a share of it, and what every GPU holds
# whatever the model (CUDA context, the collectives' buffers, library workspaces).
ALLOCATOR_SLACK = 0.094
RUNTIME_BYTES = 2 * 2**30
# A matrix product's share of the peak grows with its weight's shorter side d (on one tp rank) as
# d / (d + the kind's half size), relative to a weight whose shorter side is GEMM_REFERENCE_SIDE
# (`pipeclock.plan.gemm_efficiency`); 0 makes every product the kind's constant. Fitted on the A100's
# rows; the H100's is not yet adopted (docs/cluster.md gives what 700 does to its rows).
A100_GEMM_HALF_SIZE = 700.0
# What DeepSpeed's runs (its pipeline engine, its ZeRO) reached of the products' speed Megatron-LM's
# reached on the same GPUs: MT-NLG's 530B and Korthikanti et al.'s, same model, GPUs and degrees, were
# published 30 % apart. Not broken down into its causes (blocking point-to-point messages, no
# interleaving, its checkpointing): one named share stands for them, fitted on one run, checked on others.
DEEPSPEED_SHARE = 0.766
H100_GEMM_HALF_SIZE = 0.0
GEMM_REFERENCE_SIDE = 2048
