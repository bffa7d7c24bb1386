"""``pipeclock plan``: will the model fit, on how few stages, and which schedule is fastest there?

python -m pipeclock plan --params 10e9 --device-memory 24GB --dtype fp32    # the course's question
python -m pipeclock plan --model gpt --layers 8 --device-memory 512MB      # measured on this machine
python -m pipeclock plan --model hf --hf-config config.json --device-memory 8GB   # a Hugging Face model
python -m pipeclock plan --cluster 512xH100-80GB --hf-config llama.json      # a cluster, on paper

For each schedule x stages x micro-batches x recompute, the plan computes every rank's memory (weights,
gradients, optimizer state, activations at the schedule's peak, message buffers) and, where it fits,
the step time the simulator predicts from per-layer costs. ``--model`` measures those costs here, one
layer at a time; ``--params N`` stands for a model too large to build: a ShardedMLP-shaped stack of
``--layers`` equal layers, whose step time is counted in forwards of one layer. ``--tp N`` splits each
layer over N ranks of a stage. ``--cluster N×KIND`` plans on paper instead (`pipeclock.cli.plan_cluster`).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from typing import NamedTuple

from pipeclock.cli import plan_cluster
from pipeclock.cli.arguments import (
    add_link_arguments,
    check_output,
    link_from,
    non_negative_float,
    positive_int,
)
from pipeclock.observe.sizes import format_bytes, parse_bytes
from pipeclock.plan.planner import BALANCES, Plan
from pipeclock.plan.rank_memory import OPTIMIZER_STATE_BYTES, Recompute, Training

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32)
MAX_STAGES = 16
BAR_WIDTH = 50
_UNIT_SIZES = (
    ("B", 1), ("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12),
    ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40),
)  # fmt: skip
PART_MARKS = {
    "parameters": "P",
    "gradients": "G",
    "optimizer": "O",
    "activations": "A",
    "messages": "M",
    "workspace": "W",
    "runtime": "R",
}


class UsageError(ValueError):
    """A bad command line: one line, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model")
    model.add_argument(
        "--params", metavar="N",
        help="a rough model of N parameters (10e9, 1.3e9 ...): --layers equal square Linear layers, "
        "like ShardedMLP; its step times are in forwards of one layer",
    )  # fmt: skip
    model.add_argument(
        "--model", choices=("mlp", "gpt", "hf"), default="mlp",
        help="a built-in model, or a Hugging Face causal LM (--hf-config), measured here",
    )  # fmt: skip
    model.add_argument(
        "--hf-config", metavar="PATH",
        help="--model hf: a config.json, or a directory holding one (its sizes, random weights)",
    )  # fmt: skip
    model.add_argument(
        "--layers", type=positive_int, help="Linear layers (default 16) or GPT blocks (default 4)"
    )
    model.add_argument("--hidden", type=positive_int, default=1024, help="the MLP's width")
    model.add_argument("--dim", type=positive_int, default=128, help="the GPT's width")
    model.add_argument("--heads", type=positive_int, default=4, help="the GPT's attention heads")
    model.add_argument(
        "--seq-len", type=positive_int,
        help="the GPT's or HF model's tokens per sample (default 128; --cluster with --hf-config: 4096)",
    )  # fmt: skip
    model.add_argument("--vocab", type=positive_int, default=256, help="the GPT's vocabulary (256: bytes)")
    model.add_argument(
        "--batch-size",
        type=positive_int,
        help="samples per step (default 128 for mlp and --params, 16 for gpt and hf)",
    )
    run = parser.add_argument_group("the training")
    run.add_argument(
        "--device-memory", default="24GB", metavar="SIZE",
        help="memory of one device: 24GB (powers of 1000), 24GiB (powers of 1024), 512MB ... (default 24GB)",
    )  # fmt: skip
    run.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp8"),
        help="fp32, or bf16 autocast (default fp32; --cluster: bf16; fp8 Linears: --cluster only)",
    )  # fmt: skip
    run.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), default="adam", help="default adam")
    run.add_argument(
        "--tp", type=positive_int, default=1, metavar="N",
        help="tensor parallel: each stage's layers split over N ranks, their collectives charged on the "
        "--link-* link (default 1)",
    )  # fmt: skip
    run.add_argument(
        "--sequence-parallel", action="store_true",
        help="with --tp: the activations between the layers split over the tokens too (all-gathers and "
        "reduce-scatters in place of all-reduces)",
    )  # fmt: skip
    run.add_argument(
        "--recompute", default="none,full", metavar="LIST",
        help="activation recompute options to compare: none, full, every-K (default none,full)",
    )  # fmt: skip
    run.add_argument(
        "--balance", choices=BALANCES, default="layers",
        help="how stages are cut: by layer count, by measured time, or by memory (default layers)",
    )  # fmt: skip
    grid = parser.add_argument_group("what to compare")
    grid.add_argument("--schedules", metavar="LIST", help="schedules to compare (default: all)")
    grid.add_argument(
        "--stages", "-p", metavar="LIST", help=f"stage counts to try (default 1 to {MAX_STAGES})"
    )
    grid.add_argument(
        "--microbatches", "-m", metavar="LIST",
        help="micro-batch counts to try (default 1,2,4,8,16,32, at most the batch size)",
    )  # fmt: skip
    grid.add_argument(
        "--top", type=positive_int, default=5, help="how many configurations to list (default 5)"
    )
    grid.add_argument(
        "--threads", type=positive_int, default=1, help="threads while measuring layers (default 1)"
    )
    grid.add_argument(
        "--action-overhead", type=non_negative_float, default=0.0, metavar="MS",
        help="the engine's own time per action, added to its layers' (a measured model only): about 1 ms "
        "on 2 CPU cores over gloo (python -m benchmarks.planner measures it) (default 0)",
    )  # fmt: skip
    add_link_arguments(grid)
    grid.add_argument(
        "--runtime-memory", default="0B", metavar="SIZE",
        help="what the engine holds per rank whatever the model (its objects, buffers, the allocator's): "
        "about 2MiB on CPU over gloo (python -m benchmarks.planner measures it) (default 0B)",
    )  # fmt: skip
    parser.add_argument("--png", metavar="FILE", help="also draw the memory per rank into this PNG file")
    plan_cluster.add_arguments(parser.add_argument_group("a cluster, on paper"))


def run(args: argparse.Namespace) -> int:
    try:
        if args.cluster:
            return plan_cluster.run(args)
        plan_cluster.refuse_without_cluster(args)
        args.dtype, args.seq_len = args.dtype or "fp32", args.seq_len or 128
        if args.dtype == "fp8":
            raise UsageError("--dtype fp8 plans a cluster on paper (--cluster); this CPU trains fp32 or bf16")
        return _plan(args)
    except BrokenPipeError:
        raise  # a closed output: the command line ends quietly
    except (ValueError, OSError) as error:
        print(f"pipeclock plan: error: {error}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    from pipeclock.plan.model_layers import describe_model, model_layers

    if args.png:
        check_output(args.png, "--png")
    device = _device_memory(args.device_memory)
    runtime = parse_bytes(args.runtime_memory)
    binary = args.device_memory.strip().lower().endswith("ib")
    recomputes = [Recompute.parse(text) for text in _list(args.recompute, "--recompute")]
    training = Training(args.dtype, args.optimizer)
    model = model_layers(args)
    for flag, given in (("--action-overhead", args.action_overhead), ("--link-latency", args.link_latency),
                        ("--link-bandwidth", args.link_bandwidth)):  # fmt: skip
        if given and model.time_unit != "ms":
            raise ValueError(
                f"{flag} needs a measured model: a rough one (--params) times its layers in layer "
                "forwards, not milliseconds"
            )
    layers, unit = model.layers, model.time_unit
    stages = _stages(args.stages, len(layers))
    split = _tensor_split(args)
    _check_one_layer_fits(layers, training, device, binary, split.tp)
    schedules = _schedules(args.schedules)
    microbatches = _microbatches(args.microbatches, model.batch_size)

    print(describe_model(model, training, device, binary))
    if split.tp > 1:
        print(_tp_line(split, model.time_unit != "ms"))
    overhead = args.action_overhead / 1e3
    plans = _search(
        model, schedules, stages, microbatches, recomputes, training, args.balance, device, overhead, runtime,
        link_from(args), split,
    )  # fmt: skip
    fewest = min((plan.stages for plan in plans if plan.fits(device)), default=None)
    print()
    print("\n".join(_reasoning(model, training, device, binary, stages, plans, fewest, split.tp)))
    if fewest is None:
        print("\nnothing fits: try more stages, more micro-batches, recompute, or a larger device")
        return 1
    fitting = sorted((p for p in plans if p.fits(device)), key=lambda p: (p.step_time, p.peak, p.stages))
    at_fewest = [plan for plan in fitting if plan.stages == fewest]
    print(f"\nthe fastest on {_plural(fewest, 'stage')} (step time in {unit}; memory of the fullest rank):")
    print(_table(at_fewest[: args.top], unit, binary, model.time_scale))
    if fitting[0].stages != fewest:
        print(f"\nthe fastest on any number of stages up to {max(stages)}:")
        print(_table(fitting[: args.top], unit, binary, model.time_scale))
    best = at_fewest[0]
    marks = ", ".join(f"{m} {k}" for k, m in PART_MARKS.items() if k in best.memory[0].parts)
    print(f"\nmemory per rank, {_label(best)} ({marks}):")
    print(_bars(best, device, binary))
    if args.png:
        from pipeclock.plan.plan_png import draw_memory

        print(f"drew {draw_memory(best, device, args.png, binary)}")
    return 0


class TensorSplit(NamedTuple):
    """``--tp`` and what it needs: the collectives per kind of layer, sequence parallel."""

    tp: int = 1
    collectives: dict | None = None
    sequence_parallel: bool = False


def _tensor_split(args: argparse.Namespace) -> TensorSplit:
    """``--tp`` checked against the model's widths (a rank holds whole heads, whole columns)."""
    from pipeclock.plan.tensor_parallel import MLP, TRANSFORMER

    if args.sequence_parallel and args.tp == 1:
        raise UsageError("--sequence-parallel splits tensor parallel's activations: give --tp N (N > 1)")
    if args.params is not None or args.model == "mlp":
        width, what = (args.hidden, "--hidden") if args.params is None else (None, "")
        if width is not None and width % args.tp:
            raise UsageError(f"--tp {args.tp} does not divide the MLP's {what} {width}")
        return TensorSplit(args.tp, MLP, args.sequence_parallel)
    heads = args.heads
    if args.model == "hf" and args.hf_config:
        from pipeclock.models import hf

        heads = getattr(hf.config_of(args.hf_config), "num_attention_heads", heads)
    if heads % args.tp:
        raise UsageError(f"--tp {args.tp} does not divide the model's {heads} attention heads")
    return TensorSplit(args.tp, TRANSFORMER, args.sequence_parallel)


def _tp_line(split: TensorSplit, rough: bool) -> str:
    calls = "all-gathers and reduce-scatters" if split.sequence_parallel else "all-reduces"
    charged = (
        "not charged: a rough model's times are layer forwards, not seconds (measure one with --model)"
        if rough else "charged on the --link-* link, unhidden"
    )  # fmt: skip
    return (
        f"tensor parallel {split.tp}: each stage's layers split over {split.tp} ranks, each holding "
        f"1/{split.tp} of their matrices; their {calls} {charged}"
    )


def _search(
    model, schedules, stages, microbatches, recomputes, training, balance, device, overhead=0.0, runtime=0,
    link=None, split=None,
):  # fmt: skip
    """Every configuration's memory; the step time of those that fit (simulating costs time)."""
    from pipeclock.observe.simulate import Link
    from pipeclock.plan.planner import judge
    from pipeclock.plan.tensor_parallel import split_layers

    plans: list[Plan] = []
    split = split or TensorSplit()
    for p, name, m, recompute in itertools.product(stages, schedules, microbatches, recomputes):
        layers = [layer.scaled(math.ceil(model.batch_size / m)) for layer in model.layers]
        if split.tp > 1:
            layers = split_layers(
                layers, split.tp, split.collectives, link or Link(), split.sequence_parallel
            )
        config = Training(training.dtype, training.optimizer, recompute)
        try:  # memory first: only a plan that fits is worth simulating
            plan = judge(layers, name, p, m, config, balance, simulated=False, runtime_memory=runtime)
        except ValueError:
            continue  # this schedule cannot take (p, m) or this many stages
        if plan.fits(device):
            plan = judge(
                layers,
                name,
                p,
                m,
                config,
                balance,
                action_overhead=overhead,
                runtime_memory=runtime,
                **({"link": link} if link else {}),
            )
        plans.append(plan)
    return plans


def _reasoning(model, training, device, binary, stages, plans, fewest, tp=1) -> list[str]:
    """The course's question answered step by step: the arithmetic, then what whole layers change."""
    size = lambda count: format_bytes(count, binary)  # noqa: E731
    per = training.bytes_per_parameter
    total = per * model.parameters
    state = OPTIMIZER_STATE_BYTES[training.optimizer]
    lines = [
        "will it fit?",
        f"  per parameter: 4 B weight + 4 B gradient + {state} B {training.optimizer} state = {per} B"
        + (" (bf16 autocast keeps fp32 masters)" if training.dtype == "bf16" else ""),
        f"  the whole model: {_count(model.parameters)} x {per} B = {size(total)} to train; "
        f"ceil({size(total)} / {size(device)}) = {_plural(math.ceil(total / device), 'device')} "
        "at the very least",
    ]
    largest = max(layer.parameters for layer in model.layers)
    lines.append(
        f"  but a stage holds whole layers: {len(model.layers)} layers, the largest "
        f"{_count(largest)} parameters = {size(per * largest)} to train"
    )
    bound = math.ceil(math.ceil(total / device) / tp)  # stages, each on tp devices
    for p in sorted({plan.stages for plan in plans}):
        if p < min(bound, fewest or bound):
            continue  # below the arithmetic's bound: nothing to show
        if fewest is not None and p > fewest:
            break
        plan = _representative([plan for plan in plans if plan.stages == p], device)
        fullest = max(plan.memory, key=lambda rank: rank.total)
        static = fullest.parameters + fullest.gradients + fullest.optimizer
        moving = fullest.total - static - fullest.runtime  # activations and the rest, or the optimizer's
        runtime = f" + {size(fullest.runtime)} runtime" if fullest.runtime else ""
        verdict = "fits" if plan.fits(device) else "does not fit"
        sign = "<=" if plan.fits(device) else ">"
        held = _layers_on(plan, plan.memory.index(fullest))
        lines.append(
            f"  {_plural(p, 'stage')}: the fullest rank holds {_plural(held, 'layer')} "
            f"= {size(static)} + {size(moving)} activations, messages and temporaries{runtime} "
            f"({_label(plan)}) "
            f"= {_versus(plan.peak, device, binary)} {sign} {size(device)}: {verdict}"
        )
    if fewest is None:
        lines.append(f"  no number of stages up to {max(stages)} fits")
    else:
        split = f" x tp {tp}" if tp > 1 else ""
        lines.append(
            f"answer: {_plural(fewest, 'stage')}{split} ({_plural(fewest * tp, 'device')} of {size(device)})"
        )
    return lines


def _representative(plans: list[Plan], device: int) -> Plan:
    """The configuration that speaks for its number of stages: the fastest that fits, else the smallest."""
    fitting = [plan for plan in plans if plan.fits(device)]
    if fitting:
        return min(fitting, key=lambda plan: (plan.step_time, plan.peak))
    return min(plans, key=lambda plan: plan.peak)


def _layers_on(plan: Plan, rank: int) -> int:
    from pipeclock.engine.actions import placement_of
    from pipeclock.engine.generators import generate

    table = generate(plan.schedule, plan.stages, plan.microbatches, plan.chunks)
    return sum(len(plan.cut[s]) for s in placement_of(table).stages[rank])


def _table(plans: list[Plan], unit: str, binary: bool, time_scale: float) -> str:
    """The plans as rows; ``unit`` is said by the caller, the per-rank figures share the peak's unit."""
    shown_unit = format_bytes(plans[0].peak, binary).split()[1]
    scale = dict(_UNIT_SIZES)[shown_unit]
    header = (
        "schedule",
        "p",
        "m",
        "recompute",
        "balance",
        "step",
        "bubble",
        "peak",
        f"per rank ({shown_unit})",
    )
    rows = [header]
    for plan in plans:
        per_rank = " ".join(f"{rank.total / scale:.3g}" for rank in plan.memory)
        rows.append(
            (
                plan.schedule if plan.chunks == 1 else f"{plan.schedule} (v={plan.chunks})",
                str(plan.stages),
                str(plan.microbatches),
                str(plan.training.recompute),
                plan.balance,
                _time(plan.step_time * time_scale),
                f"{plan.bubble:.1%}",
                format_bytes(plan.peak, binary),
                per_rank if len(plan.memory) <= 8 else per_rank.split()[0] + " ...",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _bars(plan: Plan, device: int, binary: bool) -> str:
    """One bar per rank, ``BAR_WIDTH`` characters for the device's memory; ``!`` past its end."""
    lines = []
    for rank, memory in enumerate(plan.memory):
        bar, used = "", 0.0
        for part, count in memory.parts.items():
            start, used = round(used / device * BAR_WIDTH), used + count
            bar += PART_MARKS[part] * (round(used / device * BAR_WIDTH) - start)
        shown = bar[:BAR_WIDTH].ljust(BAR_WIDTH, ".") + ("!" if len(bar) > BAR_WIDTH else "")
        total = format_bytes(memory.total, binary)
        lines.append(f"rank {rank:2d} |{shown}| {total} of {format_bytes(device, binary)}")
    return "\n".join(lines)


def _versus(total: int, device: int, binary: bool) -> str:
    """``total`` with as many digits as it takes to differ from the device's size (80.004 GB > 80 GB)."""
    for digits in range(3, 10):
        shown = format_bytes(total, binary, digits)
        if total == device or shown != format_bytes(device, binary, digits):
            return shown
    return shown


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def _label(plan: Plan) -> str:
    chunks = f", v={plan.chunks}" if plan.chunks > 1 else ""
    recompute = f", recompute {plan.training.recompute}" if plan.training.recompute.enabled else ""
    return f"{plan.schedule}{chunks}, m={plan.microbatches}{recompute}"


def _time(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _count(number: int) -> str:
    for name, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if number >= size:
            return f"{number / size:.3g}{name}"
    return str(number)


# --- reading the command line -------------------------------------------------------------------------


def _device_memory(text: str) -> int:
    size = parse_bytes(text)
    if size <= 0:
        raise UsageError(f"--device-memory must be more than 0, got {text!r}")
    return size


def _list(text: str, option: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"{option} needs at least one value")
    return items


def _whole_numbers(text: str, option: str) -> list[int]:
    try:
        values = [int(item) for item in _list(text, option)]
    except ValueError:
        raise UsageError(f"{option} takes whole numbers separated by commas, got {text!r}") from None
    if min(values) < 1:
        raise UsageError(f"{option} values must be >= 1, got {text!r}")
    return sorted(set(values))


def _stages(text: str | None, num_layers: int) -> list[int]:
    if text is None:
        return list(range(1, min(num_layers, MAX_STAGES) + 1))
    stages = _whole_numbers(text, "--stages")
    if max(stages) > num_layers:
        raise UsageError(
            f"--stages {max(stages)} is more than the model's {num_layers} layers: every stage needs at "
            "least one whole layer"
        )
    return stages


def _microbatches(text: str | None, batch_size: int) -> list[int]:
    if text is None:
        return [m for m in DEFAULT_MICROBATCHES if m <= batch_size]
    values = _whole_numbers(text, "--microbatches")
    if max(values) > batch_size:
        raise UsageError(f"--microbatches {max(values)} is more than the batch's {batch_size} samples")
    return values


def _schedules(text: str | None) -> list[str]:
    from pipeclock.engine.generators import SCHEDULES

    if text is None:
        return list(SCHEDULES)
    names = _list(text, "--schedules")
    unknown = [name for name in names if name not in SCHEDULES]
    if unknown:
        raise UsageError(f"unknown schedule {unknown[0]!r}: use {', '.join(SCHEDULES)}")
    return names


def _check_one_layer_fits(layers, training: Training, device: int, binary: bool, tp: int = 1) -> None:
    largest = max(layers, key=lambda layer: layer.parameters)
    needed = training.bytes_per_parameter * math.ceil(largest.parameters / tp)
    if needed > device:
        raise UsageError(
            f"one layer alone needs {format_bytes(needed, binary)} to train ({largest.parameters:,} "
            f"parameters x {training.bytes_per_parameter} B), more than --device-memory "
            f"{format_bytes(device, binary)}: no cut into stages can fit it (use more, smaller layers, or a "
            "larger device)"
        )
