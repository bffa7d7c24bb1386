"""What ``plan --cluster`` prints: the ranked configurations, why the best wins, its memory, or why
nothing fits; and the same as JSON."""

from __future__ import annotations

from pipeclock.observe.sizes import format_bytes
from pipeclock.plan.cluster_config import DP_OUTERMOST, ZERO_WORDS, Job, Software
from pipeclock.plan.cluster_plan import Prediction
from pipeclock.plan.gpus import Cluster
from pipeclock.plan.paper_model import PaperModel
from pipeclock.plan.search import SearchResult

_FP8_WORDS = {
    "torchao": ", fp8 products keep bf16 inputs",
    "te": ", fp8 inputs and weight copies kept (Transformer Engine)",
    "te-fp8-params": ", fp8 inputs and weights kept (Transformer Engine)",
}


def header(model: PaperModel, cluster: Cluster, job: Job, software: Software) -> list[str]:
    kind, unit = cluster.kind, _unit(model)
    link = f"{kind.intra_node_link} {kind.intra_node_bandwidth / 1e9:g} GB/s inside a node"
    network = f"{kind.inter_node_bandwidth * 8 / 1e9:g} Gb/s per GPU between nodes"
    kernels = (
        ("fused" if software.fused else "eager")
        + " kernels"
        + (", tp overlapped" if software.tp_overlap else "")
        + (", bf16 gradients beside fp32" if software.gradients != "fp32" else "")
        + (", tp backward overlapped" if software.tp_backward_overlap else "")
        + (", DeepSpeed" if software.deepspeed else "")
        + (_FP8_WORDS[software.fp8] if software.dtype == "fp8" else "")
        + (", attention's scores materialized" if software.attention == "materialized" else "")
        + (", torch's pipeline stages of 2024" if software.pipelining == "torch-2024" else "")
        + (", ranks laid out dp outermost (pipeclock's mesh)" if software.rank_order == DP_OUTERMOST else "")
    )
    per_step = job.global_batch * job.seq_len
    nodes = f"{cluster.nodes} nodes of {kind.gpus_per_node}" if cluster.nodes > 1 else "one node"
    lines = [
        f"pipeclock plan: {model} on {cluster} ({nodes}; {link}, {network}), {software.dtype}, adam, "
        f"{kernels}",
        f"  {model.parameters():,} parameters; {_count(model.model_flops_per_token(job.seq_len))}FLOP per "
        f"{unit[:-1]} to train (6 x the matrix parameters"
        + (" + attention)" if model.kind == "transformer" else ")"),
    ]
    if model.kind == "transformer":
        lines.append(
            f"  a step: {job.global_batch:,} sequences of {job.seq_len:,} tokens = {per_step:,} tokens"
        )
    else:
        lines.append(f"  a step: {job.global_batch:,} samples")
    return lines


def searched(result: SearchResult, cluster: Cluster, seconds: float) -> str:
    """How much the search looked at, and in how long (a decimal point always: the docs' quotes let a
    measured number vary only where it has one)."""
    capacity = format_bytes(cluster.kind.memory, binary=True)
    took = f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds:.3f} s"
    looked = f"  searched {_configurations(result.considered)} in {took}"
    if not result.judged:
        return f"{looked}: the states fit in {capacity} in none"
    return f"{looked}: judged the {result.judged:,} that could win, {result.fitting:,} fit in {capacity}"


def table(predictions: list[Prediction], model: PaperModel) -> str:
    unit = _unit(model)
    head = ("#", f"{unit}/s/GPU", "TFLOP/s", "MFU", "memory", "step", "bubble", "configuration")
    rows = [head]
    for number, p in enumerate(predictions, 1):
        rows.append((
            str(number), figure(p.tokens_per_second_per_gpu), f"{p.tflops_per_gpu:.4g}", f"{p.mfu:.1%}",
            format_bytes(p.memory.total, binary=True), _seconds(p.time.step), f"{p.time.bubble:.1%}",
            p.config.label(),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _configurations(count: int) -> str:
    return f"{count:,} configuration{'' if count == 1 else 's'}"


def figure(value: float) -> str:
    """A rate as the reports print it: four significant digits, whole from a thousand up (no exponent)."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.4g}"


def why(ranked: list[Prediction]) -> str:
    """One line: what the best does better than the fastest configuration of another layout."""
    best = ranked[0]
    left = best.capacity - best.memory.total
    spare = f"{format_bytes(left, binary=True)} of {format_bytes(best.capacity, binary=True)} left over"
    other = next((p for p in ranked[1:] if _layout(p) != _layout(best)), None)
    if other is None:
        share, name = max((value / best.time.step, name) for name, value in _costs(best).items())
        return f"why: every close rival shares its layout; its largest cost beside compute is {name} " \
               f"({share:.0%} of the step); {spare}"  # fmt: skip
    gain = best.tokens_per_second_per_gpu / other.tokens_per_second_per_gpu - 1
    ours, theirs = _costs(best), _costs(other)
    name = max(ours, key=lambda k: theirs[k] / other.time.step - ours[k] / best.time.step)
    return (
        f"why: {gain:.1%} faster than the best {_layout_text(other)} ({other.config.label()}): {name} "
        f"takes {ours[name] / best.time.step:.0%} of its step against {theirs[name] / other.time.step:.0%}; "
        f"{spare}"
    )


def _costs(p: Prediction) -> dict[str, float]:
    """What each step spends beyond its useful compute, in seconds on the busiest rank (the bubble: the
    table's share of the pipeline's rank-time idle, which hidden communication does not shrink)."""
    t = p.time
    return {
        "the bubble": t.bubble * t.pipeline,
        "tensor parallel's collectives": t.tp,
        "recompute": t.recompute,
        "data parallel's exposed collectives": t.dp,
        "the optimizer step": t.optimizer,
    }


def _layout(p: Prediction) -> tuple:
    c = p.config
    return c.tp, c.cp, c.pp, c.dp, c.schedule, c.chunks


def _layout_text(p: Prediction) -> str:
    c = p.config
    cp = f" x cp {c.cp}" if c.cp > 1 else ""
    return f"tp {c.tp}{cp} x pp {c.pp} x dp {c.dp} layout"


def memory_line(p: Prediction) -> str:
    parts = ", ".join(f"{name} {format_bytes(value, binary=True)}" for name, value in p.memory.parts.items())
    return f"memory of the fullest GPU: {parts} = {format_bytes(p.memory.total, binary=True)}"


def nothing_fits(result: SearchResult, model: PaperModel, cluster: Cluster, software: Software) -> list[str]:
    """Why no configuration fits, in numbers: the model's states against all the cluster's memory, then
    the leanest configuration's own breakdown, which adds up to its total.

    What can be sharded is 16 B a parameter (an fp32 gradient, and the fp32 weights and Adam's two
    moments); a bf16 run's 2 B copy is not kept whole under ZeRO-3, but gathered a layer at a time."""
    capacity, count = cluster.kind.memory, cluster.count
    mixed = software.dtype != "fp32"
    per_parameter = 18 if mixed else 16
    states = model.parameters() * per_parameter
    what = "the bf16 copy, an fp32 gradient, fp32 masters and Adam's two moments" if mixed else (
        "the weight, its gradient and Adam's two moments, all fp32"
    )  # fmt: skip
    sharded, per_gpu = model.parameters() * 16, format_bytes(capacity, binary=True)
    lines = [
        f"nothing fits on {cluster} ({format_bytes(count * capacity, binary=True)} in all):",
        f"  to train, a parameter holds {per_parameter} B ({what}): {_short(model.parameters())} x "
        f"{per_parameter} B = {format_bytes(states)} = {format_bytes(states, binary=True)}",
        f"  sharded {count} ways (ZeRO-3 over tp x pp x dp), the 16 B of "
        f"{'gradient, masters and moments' if mixed else 'weight, gradient and moments'} alone take "
        f"{format_bytes(sharded / count, binary=True)} per GPU, against {per_gpu}",
    ]
    if result.smallest is not None:
        s = result.smallest
        lines.append(
            f"  the leanest configuration ({s.config.label()}) needs "
            f"{format_bytes(s.memory.total, binary=True)} per GPU: "
            + ", ".join(
                f"{name} {format_bytes(value, binary=True)}" for name, value in s.memory.parts.items()
            )
        )
    return lines


def fewest_line(count: int, best: Prediction, model: PaperModel, cluster: Cluster, fixed: dict) -> str:
    return (
        f"the fewest {cluster.kind.name} that fit{_with(fixed)}: {count}, best as {best.config.label()}: "
        f"{best.tokens_per_second_per_gpu:,.4g} {_unit(model)}/s per GPU, "
        f"{format_bytes(best.memory.total, binary=True)} per GPU"
    )


def largest_line(parameters: int, best: Prediction, model: PaperModel, cluster: Cluster, fixed: dict) -> str:
    return (
        f"the largest model of this shape that fits on {cluster}{_with(fixed)}: about {_short(parameters)} "
        f"parameters, as {best.config.label()}"
    )


def _with(fixed: dict) -> str:
    """`` with pp=4 fixed``: the follow-ups of a plan with ``--fix`` keep the fix, and say so."""
    if not fixed:
        return ""
    shown = {k: ("on" if v else "off") if isinstance(v, bool) else v for k, v in fixed.items()}
    return " with " + ",".join(f"{k}={v}" for k, v in shown.items()) + " fixed"


def zero_words() -> str:
    return ", ".join(f"{k}: {v}" for k, v in ZERO_WORDS.items())


def _unit(model: PaperModel) -> str:
    return "tokens" if model.kind == "transformer" else "samples"


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def _count(number: float) -> str:
    """FLOPs with an SI prefix: ``2.43 T``."""
    for name, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.3g} {name}"
    return f"{number:.3g} "


def _short(number: float) -> str:
    """A parameter count as people say it: ``10B``, ``405B``, ``1.3T``."""
    for name, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.3g}{name}"
    return f"{number:.3g}"
