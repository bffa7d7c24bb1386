"""A measured plan as text: the table of configurations, each rank's memory as a bar, and the course's
question (will it fit?) answered step by step.
"""

from __future__ import annotations

import math

from pipeclock.observe.sizes import format_bytes
from pipeclock.plan.planner import Plan
from pipeclock.plan.rank_memory import OPTIMIZER_STATE_BYTES

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


def reasoning(model, training, device, binary, stages, plans, fewest, tp=1) -> list[str]:
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
        f"ceil({size(total)} / {size(device)}) = {plural(math.ceil(total / device), 'device')} "
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
        plan = representative([plan for plan in plans if plan.stages == p], device)
        fullest = max(plan.memory, key=lambda rank: rank.total)
        static = fullest.parameters + fullest.gradients + fullest.optimizer
        moving = fullest.total - static - fullest.runtime  # activations and the rest, or the optimizer's
        runtime = f" + {size(fullest.runtime)} runtime" if fullest.runtime else ""
        verdict = "fits" if plan.fits(device) else "does not fit"
        sign = "<=" if plan.fits(device) else ">"
        held = _layers_on(plan, plan.memory.index(fullest))
        lines.append(
            f"  {plural(p, 'stage')}: the fullest rank holds {plural(held, 'layer')} "
            f"= {size(static)} + {size(moving)} activations, messages and temporaries{runtime} "
            f"({label(plan)}) "
            f"= {_versus(plan.peak, device, binary)} {sign} {size(device)}: {verdict}"
        )
    if fewest is None:
        lines.append(f"  no number of stages up to {max(stages)} fits")
    else:
        split = f" x tp {tp}" if tp > 1 else ""
        lines.append(
            f"answer: {plural(fewest, 'stage')}{split} ({plural(fewest * tp, 'device')} of {size(device)})"
        )
    return lines


def representative(plans: list[Plan], device: int) -> Plan:
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


def table(plans: list[Plan], unit: str, binary: bool, time_scale: float) -> str:
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


def bars(plan: Plan, device: int, binary: bool) -> str:
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


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def label(plan: Plan) -> str:
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
