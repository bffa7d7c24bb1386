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

from pipeclock.cli import plan_cluster
from pipeclock.cli.arguments import (
    add_link_arguments,
    check_output,
    link_from,
    non_negative_float,
    positive_int,
)
from pipeclock.observe.sizes import format_bytes, parse_bytes
from pipeclock.plan import plan_text
from pipeclock.plan.planner import BALANCES, Plan
from pipeclock.plan.rank_memory import OPTIMIZER_STATE_BYTES, Recompute, Training

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32)
MAX_STAGES = 16


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
    plan_cluster.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        _one_model(args)
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


def _one_model(args: argparse.Namespace) -> None:
    """The model comes one way: a rough size, a Hugging Face config, or the built-in GPT."""
    sources = (("--params", args.params is not None), ("--hf-config", bool(args.hf_config)),
               ("--model gpt", args.model == "gpt"))  # fmt: skip
    given = [flag for flag, on in sources if on]
    if len(given) > 1:
        raise ValueError(f"{given[0]} and {given[1]} each give the model: use one")


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
        print(split.describe(charged=model.time_unit == "ms"))
    overhead = args.action_overhead / 1e3
    plans = _search(
        model, schedules, stages, microbatches, recomputes, training, args.balance, device, overhead, runtime,
        link_from(args), split,
    )  # fmt: skip
    fewest = min((plan.stages for plan in plans if plan.fits(device)), default=None)
    print()
    print("\n".join(plan_text.reasoning(model, training, device, binary, stages, plans, fewest, split.tp)))
    if fewest is None:
        print("\nnothing fits: try more stages, more micro-batches, recompute, or a larger device")
        return 1
    fitting = sorted((p for p in plans if p.fits(device)), key=lambda p: (p.step_time, p.peak, p.stages))
    at_fewest = [plan for plan in fitting if plan.stages == fewest]
    on_fewest = plan_text.plural(fewest, "stage")
    print(f"\nthe fastest on {on_fewest} (step time in {unit}; memory of the fullest rank):")
    print(plan_text.table(at_fewest[: args.top], unit, binary, model.time_scale))
    if fitting[0].stages != fewest:
        print(f"\nthe fastest on any number of stages up to {max(stages)}:")
        print(plan_text.table(fitting[: args.top], unit, binary, model.time_scale))
    best = at_fewest[0]
    marks = ", ".join(f"{m} {k}" for k, m in plan_text.PART_MARKS.items() if k in best.memory[0].parts)
    print(f"\nmemory per rank, {plan_text.label(best)} ({marks}):")
    print(plan_text.bars(best, device, binary))
    if args.png:
        from pipeclock.plan.plan_png import draw_memory

        print(f"drew {draw_memory(best, device, args.png, binary)}")
    return 0


def _tensor_split(args: argparse.Namespace):
    """``--tp`` checked against the model's widths (a rank holds whole heads, whole columns)."""
    from pipeclock.plan.tensor_parallel import MLP, TRANSFORMER, TensorSplit

    if args.sequence_parallel and args.tp == 1:
        raise UsageError("--sequence-parallel splits tensor parallel's activations: give --tp N (N > 1)")
    if args.params is not None or args.model == "mlp":
        if args.params is None and args.hidden % args.tp:
            raise UsageError(f"--tp {args.tp} does not divide the MLP's --hidden {args.hidden}")
        return TensorSplit(args.tp, MLP, args.sequence_parallel)
    heads = args.heads
    if args.model == "hf" and args.hf_config:
        from pipeclock.models import hf

        heads = getattr(hf.config_of(args.hf_config), "num_attention_heads", heads)
    if heads % args.tp:
        raise UsageError(f"--tp {args.tp} does not divide the model's {heads} attention heads")
    return TensorSplit(args.tp, TRANSFORMER, args.sequence_parallel)


def _search(
    model, schedules, stages, microbatches, recomputes, training, balance, device, overhead=0.0, runtime=0,
    link=None, split=None,
):  # fmt: skip
    """Every configuration's memory; the step time of those that fit (simulating costs time)."""
    from pipeclock.observe.simulate import Link
    from pipeclock.plan.planner import judge
    from pipeclock.plan.tensor_parallel import TensorSplit, split_layers

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
