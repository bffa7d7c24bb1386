"""``plan --cluster NxKIND``: how to train this model on that cluster, predicted on paper.

python -m pipeclock plan --cluster 256xH100-80GB --hf-config llama-70b/config.json --global-batch 512
python -m pipeclock plan --cluster 512xH100-80GB --hf-config llama-405b.json --fix tp=8,pp=8 --json
python -m pipeclock plan --cluster 4xRTX4090 --params 10e9        # lab 2's memory wall, in numbers

The model comes from ``--hf-config`` (its config alone, nothing built), the built-in GPT's flags
(``--model gpt --dim --layers --heads --vocab``) or ``--params N`` (a ShardedMLP-shaped stack). Reading
the command line and printing live here; the plan itself is `pipeclock.plan.search`'s.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from pipeclock.cli.search_progress import SearchProgress
from pipeclock.engine.generators import SCHEDULES
from pipeclock.plan import calibration
from pipeclock.plan import cluster_report as report
from pipeclock.plan.cluster_config import (
    ATTENTION_KERNELS,
    CP_EXCHANGES,
    ENDS,
    FP8_KEEPS,
    GRADIENTS,
    PIPELININGS,
    RANK_ORDERS,
    RECOMPUTES,
    RETIRED_RECOMPUTES,
    ZERO_STAGES,
    Job,
    Software,
)
from pipeclock.plan.gpus import Cluster, load_spec, parse_cluster
from pipeclock.plan.hf_paper import max_positions, paper_model, read_config
from pipeclock.plan.paper_model import PaperModel, gpt_model, mlp_model
from pipeclock.plan.search import FIXABLE, SearchError, search

DEFAULT_TOKENS_PER_STEP = 2**22  # about 4M tokens a step, as large runs take
DEFAULT_SEQ_LEN = 4096
LARGEST_CLUSTER_TRIED = 2**16


@dataclass(frozen=True)
class SoftwareFlag:
    """A flag for one `Software` field: on or off (``choices`` None), or one of ``choices`` (None when not
    given, so that the field keeps `Software`'s default and a command without ``--cluster`` can tell)."""

    flag: str
    field: str
    help: str
    choices: tuple[str, ...] | None = None


# How the run computes, in the help's order; --dtype, shared with the measured planner, is not among them
SOFTWARE_FLAGS = (
    SoftwareFlag(
        "--fused", "fused",
        "--cluster: elementwise operations fused (torch.compile, fused kernels) instead of eager",
    ),
    SoftwareFlag(
        "--tp-overlap", "tp_overlap",
        "--cluster: tensor parallel's collectives overlapped with the products (AsyncTP)",
    ),
    SoftwareFlag(
        "--gradients", "gradients",
        "--cluster: what the framework keeps of each gradient: fp32 (Megatron-LM, FSDP; the default), "
        "or bf16 beside an fp32 buffer (DeepSpeed's BF16_Optimizer)",
        tuple(GRADIENTS),
    ),
    SoftwareFlag(
        "--fp8-keeps", "fp8",
        "--cluster --dtype fp8: what the fp8 products keep: bf16 inputs and weights (torchao's "
        "Float8, the default), fp8 inputs and fp8 weight copies beside bf16 weights (Transformer "
        "Engine), or fp8 inputs and fp8 weights (Transformer Engine with fp8 parameters)",
        FP8_KEEPS,
    ),
    SoftwareFlag(
        "--attention", "attention",
        "--cluster: the attention core's kernel: flash (a flash-style kernel; the default), or "
        "materialized (the score matrix through memory, as runs before FlashAttention did)",
        ATTENTION_KERNELS,
    ),
    SoftwareFlag(
        "--tp-backward-overlap", "tp_backward_overlap",
        "--cluster: the backward's tp collective runs under the weight gradients (Megatron-LM's "
        "async all-reduce)",
    ),
    SoftwareFlag(
        "--deepspeed", "deepspeed",
        "--cluster: a DeepSpeed run (its pipeline engine, its ZeRO): its products at the share of "
        "Megatron-LM's speed that published runs show (docs/cluster.md)",
    ),
    SoftwareFlag(
        "--cp-exchange", "cp_exchange",
        "--cluster: how context parallel (--fix cp=N) exchanges keys and values: torch's all-gather "
        "(the default), Megatron-Core's ring, or an all-gather left exposed (Meta's Llama 3)",
        CP_EXCHANGES,
    ),
    SoftwareFlag(
        "--pipelining", "pipelining",
        "--cluster: whose pipeline stages run the schedule: pipeclock's (the default: a micro-batch's "
        "output kept until its backward), or torch.distributed.pipelining's of December 2024 with FSDP2, "
        "as torchtitan ran them (every output kept to the step's end, a receive buffer a micro-batch, a "
        "stage's gradients from its first backward)",
        PIPELININGS,
    ),
    SoftwareFlag(
        "--rank-order", "rank_order",
        "--cluster: how the ranks are laid out, outermost first: pp-dp-tp (Megatron-LM's, torchtitan's: "
        "stages outermost; the default), or dp-pp-tp (pipeclock's mesh: replicas outermost)",
        RANK_ORDERS,
    ),
)  # fmt: skip
# The cluster's other options, before the software's in the help and in the refusal without --cluster
CLUSTER_ONLY = ("--gpu-spec", "--global-batch", "--fix", "--json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster options, in a group of their own in the plan command's help."""
    group = parser.add_argument_group("a cluster, on paper")
    group.add_argument(
        "--cluster", metavar="NxKIND",
        help="plan on paper for N GPUs of a kind: 512xH100-80GB, 4xRTX4090 ... (kinds: A100-40GB, "
        "A100-80GB, H100-80GB, H200, RTX4090, L40S, MI300X, or --gpu-spec)",
    )  # fmt: skip
    group.add_argument("--gpu-spec", metavar="FILE", help="--cluster: a GPU kind's datasheet as JSON")
    group.add_argument(
        "--global-batch", type=int, metavar="N",
        help="--cluster: sequences (samples) per step (default: about 4M tokens; --params: 128)",
    )  # fmt: skip
    group.add_argument(
        "--fix", metavar="KNOB=V,...",
        help=f"--cluster: judge one configuration with these knobs fixed ({', '.join(FIXABLE)}), the rest "
        "searched",
    )  # fmt: skip
    group.add_argument("--json", action="store_true", help="--cluster: print the configuration(s) as JSON")
    for option in SOFTWARE_FLAGS:
        takes = {"action": "store_true"} if option.choices is None else {"choices": list(option.choices)}
        group.add_argument(option.flag, **takes, help=option.help)


def refuse_without_cluster(args: argparse.Namespace) -> None:
    """The cluster's own options mean nothing to the measured planner: one line says so."""
    for flag in (*CLUSTER_ONLY, *(option.flag for option in SOFTWARE_FLAGS)):
        if getattr(args, _dest(flag)):
            raise ValueError(f"{flag} plans a cluster on paper: give --cluster NxKIND too")


def run(args: argparse.Namespace) -> int:
    """The cluster plan the command line asks for; 0 when something fits, 1 when nothing does."""
    spec = load_spec(args.gpu_spec) if args.gpu_spec else None
    cluster = parse_cluster(args.cluster, spec)
    model, seq_len = model_from(args)
    job = Job(_global_batch(args, model, seq_len), seq_len)
    if args.fp8_keeps and args.dtype != "fp8":
        raise ValueError("--fp8-keeps says what fp8 products keep: give --dtype fp8 too")
    software = software_from(args)
    cluster.kind.peak(software.dtype)  # a card without fp8 refuses it here
    fixed = parse_fix(args.fix) if args.fix else {}
    started = time.perf_counter()
    progress = SearchProgress()
    try:
        result = search(model, cluster, job, software, fixed, top=1 if fixed else args.top, progress=progress)
    finally:
        progress.close()
    seconds = time.perf_counter() - started
    if args.json:
        return _print_json(result, fixed)
    print("\n".join(report.header(model, cluster, job, software)))
    print(report.searched(result, cluster, seconds))
    if not result.ranked:
        print("\n".join(["", *report.nothing_fits(result, model, cluster, software)]))
        fewest = _fewest(model, cluster, job, software, fixed)
        if fewest is not None:
            print(report.fewest_line(*fewest, model, cluster, fixed))
        if model.kind == "mlp":
            largest = _largest(model, cluster, job, software, fixed)
            if largest is not None:
                print(report.largest_line(*largest, model, cluster, fixed))
        return 1
    print()
    print(report.table(result.ranked, model))
    print()
    print(report.why(result.ranked))
    print(report.memory_line(result.ranked[0]))
    return 0


def software_from(args: argparse.Namespace) -> Software:
    """The `Software` the flags describe; a flag not given leaves its field at `Software`'s default."""
    given = ((option.field, getattr(args, _dest(option.flag))) for option in SOFTWARE_FLAGS)
    return Software(args.dtype or "bf16", **{field: value for field, value in given if value is not None})


def _dest(flag: str) -> str:
    """The attribute argparse keeps a flag's value in: ``--fp8-keeps`` in ``fp8_keeps``."""
    return flag.removeprefix("--").replace("-", "_")


def model_from(args: argparse.Namespace) -> tuple[PaperModel, int]:
    """The model on paper the flags describe, and the tokens per sequence (1 for a ShardedMLP)."""
    if args.hf_config:
        config = read_config(args.hf_config)
        path = Path(args.hf_config)
        model = paper_model(config, path.parent.name if path.name == "config.json" else path.stem)
        positions = max_positions(config)
        seq_len = args.seq_len or min(DEFAULT_SEQ_LEN, positions or DEFAULT_SEQ_LEN)
        if positions is not None and seq_len > positions:
            raise ValueError(f"--seq-len {seq_len} is longer than the model's {positions} positions")
        return model, seq_len
    if args.params is not None:
        return mlp_model(_parameters(args.params), args.layers or 16), 1
    if args.model == "gpt":
        return gpt_model(args.dim, args.layers or 4, args.heads, args.vocab), args.seq_len or 128
    if args.model == "hf":
        raise ValueError("--model hf needs --hf-config PATH (a config.json, or a directory holding one)")
    hidden = args.hidden
    return PaperModel(f"ShardedMLP {args.layers or 16} x {hidden}", args.layers or 16, hidden, kind="mlp"), 1


def _parameters(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--params takes a number of parameters like 10e9 or 1.3e9, got {text!r}") from None
    if not 1 <= value < float("inf"):
        raise ValueError(f"--params must be at least 1, got {text!r}")
    return round(value)


def _global_batch(args, model: PaperModel, seq_len: int) -> int:
    if args.global_batch is not None:
        if args.global_batch < 1:
            raise ValueError(f"--global-batch must be >= 1, got {args.global_batch}")
        return args.global_batch
    if model.kind == "mlp":
        return args.batch_size or 128
    return max(1, DEFAULT_TOKENS_PER_STEP // seq_len)


def parse_fix(text: str) -> dict:
    """``tp=8,pp=16,schedule=1f1b`` as a dict of knobs, each value checked."""
    fixed: dict = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        knob, _, value = item.partition("=")
        knob, value = knob.strip(), value.strip()
        if knob not in FIXABLE or not value:
            raise ValueError(f"--fix takes KNOB=VALUE pairs with knobs {', '.join(FIXABLE)}, got {item!r}")
        if knob in fixed:
            raise ValueError(f"--fix names {knob} twice ({text!r}): give each knob once")
        fixed[knob] = _fixed_value(knob, value)
    if not fixed:
        raise ValueError("--fix needs at least one KNOB=VALUE")
    return fixed


def _fixed_value(knob: str, value: str):
    if knob == "schedule":
        if value not in SCHEDULES:
            raise ValueError(f"--fix schedule={value}: unknown schedule; use {', '.join(SCHEDULES)}")
        return value
    if knob == "recompute":
        if value in RETIRED_RECOMPUTES:
            raise ValueError(f"--fix recompute={value} is two policies now: {RETIRED_RECOMPUTES[value]}")
        if value not in RECOMPUTES:
            raise ValueError(f"--fix recompute={value}: use {', '.join(RECOMPUTES)}")
        return value
    if knob == "ends":
        if value not in ENDS:
            raise ValueError(f"--fix ends={value}: use ride (the embedding and the head with the first and "
                             "last blocks) or slot (a block's slot each, Meta's Llama 3)")  # fmt: skip
        return value
    if knob == "sp":
        if value not in ("on", "off"):
            raise ValueError(f"--fix sp={value}: use on or off")
        return value == "on"
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"--fix {knob}={value}: a whole number is needed") from None
    if knob == "zero" and number not in ZERO_STAGES:
        raise ValueError(f"--fix zero={value}: use 0, 1, 2 or 3 ({report.zero_words()})")
    if knob != "zero" and number < 1:
        raise ValueError(f"--fix {knob}={value} must be >= 1")
    return number


def _print_json(result, fixed: dict) -> int:
    if fixed:
        chosen = result.ranked[0] if result.ranked else result.smallest
        print(json.dumps(chosen.as_json() if chosen else None, indent=2))
    else:
        print(json.dumps([p.as_json() for p in result.ranked], indent=2))
    return 0 if result.ranked else 1


def _largest(model: PaperModel, cluster: Cluster, job: Job, software: Software, fixed: dict):
    """The most parameters a model of the same layer count trains with on ``cluster`` with the ``fixed``
    knobs (bisection over the parameter count), and the best configuration there; None when even a tiny
    one does not fit."""

    def best(parameters: int):
        try:
            found = search(mlp_model(parameters, model.layers), cluster, job, software, fixed, top=1)
        except SearchError:
            return None
        return found.ranked[0] if found.ranked else None

    low, high = model.layers, model.parameters()
    if best(low) is None:
        return None
    while high / low > 1.01:
        middle = round((low * high) ** 0.5)
        low, high = (middle, high) if best(middle) is not None else (low, middle)
    return low, best(low)


def _fewest(model, cluster: Cluster, job: Job, software: Software, fixed: dict):
    """The fewest GPUs of the same kind on which something fits with the ``fixed`` knobs (one more at a
    time up to four times the cluster, then doubling), and the best configuration there; None at once for
    a GPU whose memory the runtime's own allowance (CUDA context, collectives' buffers) fills: no count of
    them fits anything."""
    if cluster.kind.memory <= calibration.RUNTIME_BYTES:
        return None
    count = cluster.count + 1
    while count <= LARGEST_CLUSTER_TRIED:
        try:
            found = search(model, Cluster(count, cluster.kind), job, software, fixed, top=1)
        except SearchError:  # no data-parallel degree of this count divides the batch, or the fix
            found = None
        if found is not None and found.ranked:
            return count, found.ranked[0]
        count = count + 1 if count < 4 * cluster.count else count * 2
    return None
