"""Published A100 runs for the cluster check: Megatron-LM 2021 and 2022, BLOOM (Megatron-DeepSpeed), MT-NLG.

Each row gives the run's own knobs to ``plan --fix`` and its published speed as tokens/s per GPU: a
figure that does not depend on how a paper counts FLOPs. Where a source gives TFLOP/s, the tokens are
its TFLOP/s over its own FLOPs per token; where it gives iteration times, the step's tokens over them.

Sources:
- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (SC21, arXiv 2104.04473), Table 1: GPTs of 1.7B to 1T parameters, vocabulary 51,200, sequences of
  2,048, on DGX A100-80GB (Selene), fp16 mixed precision (the A100's fp16 and bf16 peaks are the same).
  The knobs the table omits (micro-batch, virtual stages, full recompute, DDP) are those of the
  paper's own script, NVIDIA/Megatron-LM ``examples/academic_paper_scripts/sc21/run_table_1.sh``
  (commit f2e72c8a). Its TFLOP/s count the recompute's extra forward (Eq. 3:
  96 B s l h^2 (1 + s/6h + V/16lh) per iteration, four passes through the layers).
- BigScience BLOOM 176B (arXiv 2211.05100), run on Megatron-DeepSpeed: bigscience-workshop/bigscience
  ``train/tr11-176B-ml/tr11-176B-ml.slurm`` at commit 1a829a2d (48 nodes; later commits moved to 24)
  (tp 4, pp 12, micro-batch 2, global batch 2,048 x 2,048,
  bf16, full recompute, DeepSpeed ZeRO stage 0 with its bf16 optimizer's own ZeRO-1 sharding), its README
  (384 A100-80GB, dp 8) and ``chronicles.md`` 2022-03-18 ("at full throttle of GBS=2048 and at 149-150
  TFLOPs per GPU. A single train iteration is about 105 secs."); memory: the BigScience model page
  (bigscience.notion.site, "BigScience 176B Model": "one copy of the model takes 48 GPUs (using 60 GB
  of memory on each GPU)"; read as GiB, the unit nvidia-smi's figures are in: 55.9 GiB if decimal GB).
- Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv 2201.11990),
  section 3.2: 105 layers, width 20,480, 128 heads, sequences of 2,048, 8-way tensor and 35-way
  pipeline parallel; section 2.4: global batch 1,920 on 280, 350 and 420 DGX A100 servers: 60.1, 50.2
  and 44.4 s an iteration (126, 121 and 113 TFLOP/s per GPU). Its vocabulary is taken as Table 1's
  51,200 for the same shape (the head is under 1 % of the FLOPs).
- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198,
  v1), Megatron-LM with sequence parallel and selective recompute on DGX A100-80GB (Selene), mixed
  precision, sequences of 2,048, vocabulary 51,200: Table 3 (each model's heads, width, layers, tp, pp,
  GPUs, global batch and micro-batch; no data parallel), section 6 (three interleaved stages per rank
  for the 175B and 530B), Table 5 (iteration seconds with full recompute and with "present work",
  sequence parallel with selective recompute) and section 6.3 (the 530B at 8-way data parallel on
  2,240 GPUs, the batch multiplied by 8: 39.15 s; no overlap of the gradient all-reduce). The abstract
  gives that run's full-recompute MFU, 42.1 %, read back to tokens by the paper's model FLOPs (Appendix
  A, Eq. 7: 72 B L s h^2 (1 + s/6h + v/12hL) an iteration, no recompute counted) and the A100's 312
  TFLOP/s. Table 5's MFUs (41.5, 51.4, 56.0, 56.3 %) are also in the Megatron-LM README of 2022-05-19
  (commit 2e90a342f5), "measured using a data parallel size of one"; its seconds give the same to 0.2 %.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeclock.plan.paper_model import PaperModel

NARAYANAN = "Narayanan et al. 2021, Table 1"
BLOOM = "BLOOM 176B (BigScience 2022)"
MT_NLG = "MT-NLG 530B (Smith et al. 2022)"
KORTHIKANTI = "Korthikanti et al. 2022"
A100_PEAK = 312e12  # dense fp16/bf16 FLOP/s, the peak the papers' utilizations divide by
GPT_VOCAB, GPT_SEQ = 51200, 2048


@dataclass(frozen=True)
class PublishedRun:
    """One published A100 run: its model, GPUs, batch, the knobs it fixed, and what it published."""

    source: str
    name: str
    model: tuple  # ("gpt", heads, hidden, layers, vocab) or ("bloom", heads, hidden, layers, vocab)
    gpus: int
    kind: str  # the GPU kind's name in pipeclock.plan.gpus.KINDS
    global_batch: int
    seq_len: int
    fix: str  # plan --fix, as the run fixed it
    tokens_per_gpu: float  # published, per second
    memory_gib: float | None
    role: str  # "fit" or "check"
    attention: str = "materialized"  # every run here predates flash-style kernels in its framework
    deepspeed: bool = False  # run on DeepSpeed (`calibration.DEEPSPEED_SHARE`)
    gradients: str = "fp32"  # what the framework keeps of a gradient (`cluster_config.GRADIENTS`)
    tp_backward_overlap: bool = False  # Megatron-LM's async tp all-reduce (since 2021-09): its 2022 runs


def narayanan_tokens_per_gpu(tflops: float, layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Tokens/s per GPU from Table 1's TFLOP/s, by the paper's own count (its Eq. 3 over B s tokens)."""
    flops_per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return tflops * 1e12 / flops_per_token


# Table 1: (size, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s) and run_table_1.sh's micro-batch
# and layers per virtual stage (0: no interleaving); every run recomputes each layer in full.
TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 0, "check"),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 0, "check"),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 0, "check"),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 0, "fit"),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 0, "check"),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, "check"),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, "fit"),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, "check"),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, "check"),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 0, "check"),
]  # fmt: skip


def _table_1() -> list[PublishedRun]:
    runs = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, tflops, mbs, per_virtual, role in TABLE_1:
        dp = gpus // (tp * pp)
        schedule = f"schedule=interleaved-1f1b,chunks={layers // pp // per_virtual}" if per_virtual else (
            "schedule=1f1b"
        )  # fmt: skip
        fix = f"tp={tp},pp={pp},dp={dp},microbatch-size={mbs},recompute=full,zero=0,sp=off,{schedule}"
        tokens = narayanan_tokens_per_gpu(tflops, layers, hidden, GPT_SEQ, GPT_VOCAB)
        runs.append(PublishedRun(NARAYANAN, f"GPT {size}", ("gpt", heads, hidden, layers, GPT_VOCAB), gpus,
                                 "A100-80GB", batch, GPT_SEQ, fix, tokens, None, role))  # fmt: skip
    return runs


def korthikanti_model_flops(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Model FLOPs per token as Korthikanti et al. count them (Appendix A, Eq. 7 over B s tokens): the
    products of a forward and a backward, none of the recompute's."""
    return 72 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


# Table 3: (size, heads, hidden, layers, tp, pp, GPUs, global batch, micro-batch), with section 6's
# interleaved stages per rank (0: none), and Table 5: seconds an iteration, full recompute and present work.
KORTHIKANTI_RUNS = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 0, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 0, 94.42, 71.49),
]  # fmt: skip
# Section 6.3: the 530B at dp 8 on 2,240 GPUs, 39.15 s with present work; the abstract: 42.1 % MFU with
# full recompute (no seconds published).
KORTHIKANTI_DP8 = {"gpus": 2240, "batch": 280 * 8, "present": 39.15, "full_mfu": 0.421}
# the one run of theirs the A100 constants are fitted on (docs/cluster.md says why not MT-NLG's)
KORTHIKANTI_FIT = ("175B", "present")
SOFTWARE_2022 = {"full": "recompute=full,sp=off", "present": "recompute=selective-attention,sp=on"}


def _korthikanti() -> list[PublishedRun]:
    runs = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, mbs, chunks, full, present in KORTHIKANTI_RUNS:
        model = ("gpt", heads, hidden, layers, GPT_VOCAB)
        schedule = f"schedule=interleaved-1f1b,chunks={chunks}" if chunks else "schedule=1f1b"
        for policy, seconds in (("full", full), ("present", present)):
            fix = f"tp={tp},pp={pp},dp=1,microbatch-size={mbs},{SOFTWARE_2022[policy]},zero=0,{schedule}"
            role = "fit" if (size, policy) == KORTHIKANTI_FIT else "check"
            runs.append(PublishedRun(KORTHIKANTI, f"GPT {size}, {_policy_words(policy)}", model, gpus,
                                     "A100-80GB", batch, GPT_SEQ, fix, batch * GPT_SEQ / seconds / gpus,
                                     None, role, tp_backward_overlap=True))  # fmt: skip
    _, heads, hidden, layers, tp, pp, *_ = KORTHIKANTI_RUNS[2]
    gpus, batch = KORTHIKANTI_DP8["gpus"], KORTHIKANTI_DP8["batch"]
    per_token = korthikanti_model_flops(layers, hidden, GPT_SEQ, GPT_VOCAB)
    published = {
        "full": KORTHIKANTI_DP8["full_mfu"] * A100_PEAK / per_token,
        "present": batch * GPT_SEQ / KORTHIKANTI_DP8["present"] / gpus,
    }
    for policy, tokens in published.items():
        fix = (f"tp={tp},pp={pp},dp={gpus // (tp * pp)},microbatch-size=1,{SOFTWARE_2022[policy]},zero=0,"
               "schedule=interleaved-1f1b,chunks=3")  # fmt: skip
        runs.append(PublishedRun(KORTHIKANTI, f"GPT 530B dp 8, {_policy_words(policy)}",
                                 ("gpt", heads, hidden, layers, GPT_VOCAB), gpus, "A100-80GB", batch, GPT_SEQ,
                                 fix, tokens, None, "check", tp_backward_overlap=True))  # fmt: skip
    return runs


def _policy_words(policy: str) -> str:
    return "full recompute" if policy == "full" else "sp + selective"


def _bloom() -> PublishedRun:
    gpus, batch, seq, seconds = 384, 2048, 2048, 105.0
    fix = "tp=4,pp=12,dp=8,microbatch-size=2,recompute=full,zero=1,sp=off,schedule=1f1b"
    model = ("bloom", 112, 14336, 70, 250880)
    return PublishedRun(BLOOM, "tp 4 x pp 12 x dp 8", model, gpus, "A100-80GB", batch, seq, fix,
                        batch * seq / seconds / gpus, 60.0, "check",
                        gradients="bf16+fp32", deepspeed=True)  # DeepSpeed's BF16_Optimizer  # fmt: skip


def _mt_nlg() -> list[PublishedRun]:
    runs = []
    for servers, seconds, role in ((280, 60.1, "check"), (350, 50.2, "fit"), (420, 44.4, "check")):
        gpus = 8 * servers
        fix = f"tp=8,pp=35,dp={gpus // 280},recompute=full,sp=off,schedule=1f1b"
        model = ("gpt", 128, 20480, 105, GPT_VOCAB)  # Table 1's 529.6B shape and vocabulary
        runs.append(PublishedRun(MT_NLG, f"{servers} DGX servers", model, gpus, "A100-80GB", 1920, 2048, fix,
                                 1920 * 2048 / seconds / gpus, None, role, deepspeed=True))  # fmt: skip
    return runs


def runs() -> list[PublishedRun]:
    """Every published A100 run of the check, in the order of docs/cluster.md's table."""
    return [*_table_1(), _bloom(), *_mt_nlg(), *_korthikanti()]


def paper(run: PublishedRun) -> PaperModel:
    """The run's model on paper: Megatron-LM's GPT of the time (GPT-2's shape, learned positions, the
    embedding and the head tied, as Table 1's parameter count has them) or BLOOM's (ALiBi, no position
    table). Built directly, as `pipeclock.plan.hf_paper` reads GPT2Config and BloomConfig (a test holds
    them equal), so the check does not import transformers."""
    family, heads, hidden, layers, vocab = run.model
    name = "BLOOM 176B" if family == "bloom" else run.name
    positions = 0 if family == "bloom" else run.seq_len
    return PaperModel(name, layers, hidden, heads, heads, hidden // heads, 4 * hidden, vocab, gated=False,
                      tied=True, norm="layer", linear_bias=True, positions=positions)  # fmt: skip
