"""What a cluster plan chooses (`Config`) and what it takes as given (`Software`, `Job`).

A cluster run's ranks are laid out pp x dp x tp, pp outermost and tp innermost, as Megatron-LM
(order tp-cp-ep-dp-pp) and torchtitan (mesh pp, dp_replicate, dp_shard, cp, tp) lay them out: the tp
ranks of a stage are consecutive (one node), the replicas of a stage tp ranks apart, the stages of one
pipeline dp x tp apart (sources: docs/cluster.md).
"""

from __future__ import annotations

from dataclasses import dataclass

# selective-attention: Megatron-LM's (Korthikanti et al. 2022), the attention core run again;
# selective-op: torchtitan's op-level policy, every other matrix product's output kept
RECOMPUTES = ("none", "selective-attention", "selective-op", "full")
RETIRED_RECOMPUTES = {
    "selective": "selective-attention (Megatron-LM's: the attention core) or selective-op "
    "(torchtitan's: every other matrix product)"
}
ZERO_STAGES = (0, 1, 2, 3)
ATTENTION_KERNELS = ("flash", "materialized")  # see pipeclock.plan.attention_core
DTYPES = ("fp32", "bf16", "fp8")
# What the framework keeps of a parameter's gradient through the step, in mixed precision: fp32 alone
# (Megatron-LM's main_grad, FSDP's sharded gradient), or the bf16 gradient autograd writes beside an fp32
# accumulation buffer (DeepSpeed's BF16_Optimizer, which keeps the bf16 ones between micro-batches).
GRADIENTS = {"fp32": 4, "bf16+fp32": 6}
ZERO_WORDS = {0: "replicated (DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP (ZeRO-3)"}


@dataclass(frozen=True)
class Software:
    """How the run computes, the same for every configuration of a search.

    ``dtype``: fp32, bf16 (autocast over fp32 master weights), or fp8 (the Linear layers' products in
    float8, the rest bf16). ``fused``: the elementwise operations fused into few kernels (torch.compile,
    or a framework's fused kernels), else run one by one as eager PyTorch runs them. ``tp_overlap``: tensor
    parallel's collectives overlapped with the matrix products (torchtitan's AsyncTP, Megatron-LM's
    ``--tp-comm-overlap``); plain ``parallelize_module`` waits for them. ``attention``: a flash-style
    kernel, or the score matrix materialized as runs before 2023 did (`pipeclock.plan.attention_core`).
    ``gradients``: what the framework keeps of each gradient (`GRADIENTS`).
    ``tp_backward_overlap``: the backward's collective of each column-parallel product's input gradient
    (all-reduce, or with sequence parallel reduce-scatter) runs while that product's weight gradient
    computes, as Megatron-LM does by default since September 2021 (``--no-async-tensor-model-parallel-
    allreduce`` turns it off); hidden up to those weight gradients' time.
    ``deepspeed``: a DeepSpeed run, whose products reach ``calibration.DEEPSPEED_SHARE`` of the speed the
    others' reach."""

    dtype: str = "bf16"
    fused: bool = False
    tp_overlap: bool = False
    attention: str = "flash"
    gradients: str = "fp32"
    tp_backward_overlap: bool = False
    deepspeed: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use {', '.join(DTYPES)}")
        if self.attention not in ATTENTION_KERNELS:
            kernels = " or ".join(ATTENTION_KERNELS)
            raise ValueError(f"unknown attention kernel {self.attention!r}: use {kernels}")
        if self.gradients not in GRADIENTS:
            raise ValueError(f"unknown gradients {self.gradients!r}: use {' or '.join(GRADIENTS)}")

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element: fp32's 4, else bf16's 2 (fp8 keeps bf16 activations)."""
        return 4 if self.dtype == "fp32" else 2


@dataclass(frozen=True)
class Job:
    """The training job: ``global_batch`` sequences of ``seq_len`` tokens per step."""

    global_batch: int
    seq_len: int


@dataclass(frozen=True)
class Config:
    """One way to run the job: the three degrees, the schedule and its chunks per rank, the micro-batch
    size (sequences) and count per replica, activation recompute, the data-parallel sharding (ZeRO
    stage: 0 replicates everything, 1 shards the optimizer state, 2 the gradients too, 3 the weights
    too) and sequence parallel (tensor parallel's norms and residuals split over the tokens)."""

    tp: int
    pp: int
    dp: int
    schedule: str
    chunks: int
    microbatch_size: int
    microbatches: int
    recompute: str
    zero: int
    sequence_parallel: bool
    ep: int = 1  # expert parallel: each MoE layer's experts over ep of the dp ranks (`plan.experts`)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        schedule = self.schedule if self.chunks == 1 or self.schedule in ("zb-v", "dualpipev") else (
            f"{self.schedule} v={self.chunks}"
        )  # fmt: skip
        sp = "+sp" if self.sequence_parallel else ""
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        return (
            f"tp {self.tp}{sp} x pp {self.pp} x dp {self.dp}{ep}, {schedule}, mbs {self.microbatch_size} x "
            f"m {self.microbatches}, recompute {self.recompute}, {ZERO_WORDS[self.zero]}"
        )
