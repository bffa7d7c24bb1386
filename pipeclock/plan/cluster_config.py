"""What a cluster plan chooses (`Config`) and what it takes as given (`Software`, `Job`).

A cluster run's ranks are laid out in one of two orders (`Software.rank_order`), tp innermost in both:
pipeclock's own mesh, dp x pp x tp with dp outermost (`pipeclock.parallel.mesh`), or pp x dp x cp x tp
with pp outermost, as Megatron-LM (order tp-cp-ep-dp-pp) and torchtitan (mesh pp, dp_replicate,
dp_shard, cp, tp) lay them out. Either way the tp ranks of a stage are consecutive (one node) and its
context-parallel ranks (`pipeclock.plan.context_parallel`) tp apart; pipeclock has no cp, so under its
order cp keeps that place, dp x pp x cp x tp. Where the rest sit: `pipeclock.plan.group_link`.
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
# How context parallel's ranks exchange keys and values (see pipeclock.plan.context_parallel): torch's
# context_parallel by default, Megatron-Core's (Transformer Engine's) ring, Meta's Llama 3 all-gather
CP_EXCHANGES = ("all-gather", "ring", "all-gather-exposed")
# What the framework keeps of a parameter's gradient through the step, in mixed precision: fp32 alone
# (Megatron-LM's main_grad, FSDP's sharded gradient), or the bf16 gradient autograd writes beside an fp32
# accumulation buffer (DeepSpeed's BF16_Optimizer, which keeps the bf16 ones between micro-batches).
GRADIENTS = {"fp32": 4, "bf16+fp32": 6}
# What an fp8 run keeps of its products' operands (`Software.fp8`). torchao's Float8Linear (torchtitan)
# keeps each product's bf16 input and weight and casts them again in its backward. Transformer Engine keeps
# each product's input as its fp8 cast, one byte an element (`activations.layer_bytes`), and each weight's
# fp8 cast with its transpose (Hopper's fp8 products take both operands row-major, so the backward's
# product needs the transposed copy), cached through the step's micro-batches: beside the bf16 weights
# ("te"), or in their place when the weights are fp8 themselves ("te-fp8-params": TE's fp8_model_init,
# Megatron-Core's --fp8-param-gather, NeMo's fp8_params), the fp32 masters staying with the optimizer.
FP8_KEEPS = ("torchao", "te", "te-fp8-params")
ZERO_WORDS = {0: "replicated (DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP (ZeRO-3)"}
# Where the embedding and the head go in the pipeline's cut (`Config.ends`): riding with the first and the
# last blocks' stages, or each in a block's slot of its own, so that the first and the last stages hold a
# block fewer (Meta's Llama 3, arXiv 2407.21783 section 3.3.2)
ENDS = ("ride", "slot")
# Whose pipeline stages run the schedule (`Software.pipelining`): pipeclock's own, or those of
# torch.distributed.pipelining of December 2024 with FSDP2, as torchtitan ran them (`plan.stage_buffers`)
PIPELININGS = ("pipeclock", "torch-2024")
# How the ranks are laid out (`Software.rank_order`, outermost first): pipeclock's mesh, dp outermost, or
# Megatron-LM's and torchtitan's, pp outermost (the module's docstring)
DP_OUTERMOST, PP_OUTERMOST = "dp-pp-tp", "pp-dp-tp"
RANK_ORDERS = (DP_OUTERMOST, PP_OUTERMOST)


@dataclass(frozen=True)
class Software:
    """How the run computes, the same for every configuration of a search:

    - ``dtype``: "fp32", "bf16" (autocast over fp32 master weights) or "fp8" (the Linear products; rest bf16)
    - ``fused``: elementwise operations fused (torch.compile, fused kernels), or one by one as eager runs them
    - ``tp_overlap``: tp's collectives overlapped with the products (AsyncTP, ``--tp-comm-overlap``), or not
    - ``attention``: the attention core's kernel: "flash" or "materialized" (`pipeclock.plan.attention_core`)
    - ``gradients``: what the framework keeps of each gradient: "fp32" or "bf16+fp32" (`GRADIENTS`)
    - ``tp_backward_overlap``: the backward's tp collective runs under the weight gradients (Megatron-LM's)
    - ``deepspeed``: a DeepSpeed run: its products at ``calibration.DEEPSPEED_SHARE`` of the others' speed
    - ``fp8``: what an fp8 run's products keep: "torchao", "te" or "te-fp8-params" (`FP8_KEEPS`)
    - ``cp_exchange``: cp's exchange of keys and values: "all-gather", "ring" or "all-gather-exposed"
    - ``repeat_kv``: key and value heads repeated to the query heads before attention, and so moved by cp
    - ``tp_gathered_inputs``: under sp, column-parallel products keep inputs gathered (`plan.activations`)
    - ``recompute_stops_early``: a full recompute stops at the backward's last read (`plan.recompute_tail`)
    - ``pipelining``: whose stages run the pipeline: "pipeclock" or "torch-2024" (`plan.stage_buffers`)
    - ``rank_order``: the ranks' layout: "pp-dp-tp" (Megatron-LM's, torchtitan's) or "dp-pp-tp" (pipeclock's)
    """

    dtype: str = "bf16"
    fused: bool = False
    tp_overlap: bool = False
    attention: str = "flash"
    gradients: str = "fp32"
    tp_backward_overlap: bool = False
    deepspeed: bool = False
    fp8: str = "torchao"
    cp_exchange: str = "all-gather"
    repeat_kv: bool = False
    tp_gathered_inputs: bool = False
    recompute_stops_early: bool = False
    pipelining: str = "pipeclock"
    rank_order: str = PP_OUTERMOST

    def __post_init__(self) -> None:
        if self.cp_exchange not in CP_EXCHANGES:
            raise ValueError(f"unknown cp exchange {self.cp_exchange!r}: use {', '.join(CP_EXCHANGES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use {', '.join(DTYPES)}")
        if self.attention not in ATTENTION_KERNELS:
            kernels = " or ".join(ATTENTION_KERNELS)
            raise ValueError(f"unknown attention kernel {self.attention!r}: use {kernels}")
        if self.gradients not in GRADIENTS:
            raise ValueError(f"unknown gradients {self.gradients!r}: use {' or '.join(GRADIENTS)}")
        if self.fp8 not in FP8_KEEPS:
            raise ValueError(f"unknown fp8 keeping {self.fp8!r}: use {', '.join(FP8_KEEPS)}")
        if self.pipelining not in PIPELININGS:
            raise ValueError(f"unknown pipelining {self.pipelining!r}: use {' or '.join(PIPELININGS)}")
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(f"unknown rank order {self.rank_order!r}: use {' or '.join(RANK_ORDERS)}")

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element: fp32's 4, else bf16's 2 (an fp8 run's products compute in fp8,
        the rest in bf16; what its products keep: `saved_input_bytes`)."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def saved_input_bytes(self) -> int | None:
        """Bytes of an element that a product keeps of its input for the backward when that is its fp8
        cast (Transformer Engine's fp8): 1; None when it keeps the activation as it came."""
        return 1 if self.dtype == "fp8" and self.fp8 != "torchao" else None

    @property
    def fp8_weight_copy_bytes(self) -> int:
        """Bytes per block weight that an fp8 run keeps beside its bf16 weights: Transformer Engine's fp8
        cast and its transpose (2), unless the weights are fp8 themselves (`FP8_KEEPS`)."""
        return 2 if self.dtype == "fp8" and self.fp8 == "te" else 0


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
    too) and sequence parallel (tensor parallel's norms and residuals split over the tokens). ``cp``:
    context parallel, each sequence's tokens split over cp ranks that hold the same weights
    (`pipeclock.plan.context_parallel`); the data-parallel group that reduces and shards is dp x cp.
    ``ends``: the embedding and the head ride with the first and the last stages (``ride``), or take a
    block's slot each in the cut (``slot``: the blocks and the two ends cut evenly, so the first and the
    last stages hold a block fewer; with one block a virtual stage, the first holds the embedding alone
    and the last the head and the loss alone, as Meta's Llama 3 pipeline does)."""

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
    cp: int = 1
    ends: str = "ride"

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def replicas(self) -> int:
        """The ranks that hold the same weights and reduce (and under ZeRO shard) their states: dp x cp."""
        return self.dp * self.cp

    def label(self) -> str:
        schedule = self.schedule if self.chunks == 1 or self.schedule in ("zb-v", "dualpipev") else (
            f"{self.schedule} v={self.chunks}"
        )  # fmt: skip
        sp = "+sp" if self.sequence_parallel else ""
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        ends = ", ends in slots" if self.ends == "slot" else ""
        return (
            f"tp {self.tp}{sp}{cp} x pp {self.pp} x dp {self.dp}{ep}, {schedule}, "
            f"mbs {self.microbatch_size} x m {self.microbatches}, recompute {self.recompute}, "
            f"{ZERO_WORDS[self.zero]}{ends}"
        )
