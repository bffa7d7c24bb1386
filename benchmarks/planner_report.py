"""The page ``python -m benchmarks.planner`` writes: predicted against measured, per configuration."""

from __future__ import annotations

import statistics

STEP_TOLERANCE = 0.15  # the target: a predicted step within 15 % of the measured one


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "-"


def _step_error(record: dict) -> str:
    """The median over rounds of each round's (predicted - measured) / measured."""
    return f"{record['step_ratio'] - 1:+.1%}"


def _mb(count: float) -> str:
    return f"{count / 2**20:.2f}"


def markdown(
    records: list[dict],
    command: str,
    seconds: float,
    loads: list[float],
    microbatches: int,
    engine_model: str,
) -> str:
    """The results page: the grid's table, its step-time count, and the balance comparison."""
    lines = [
        "# The planner against real runs",
        "",
        f"`{command}` ({seconds:.0f} s), 2 ranks, {microbatches} micro-batches, Adam. "
        "Memory in MiB per rank (rank 0 / rank 1); error = (predicted - measured) / measured; the step's "
        "error is the median over rounds of each round's. The machine's 1-minute load average during the "
        f"timed rounds: {min(loads):.1f} to {max(loads):.1f} (on 2 cores). The predicted step is the "
        "simulator fed with the layers' profile (layers only) and with the engine's own time per action, "
        f"measured in the same round as the step of a model too small to compute ({engine_model}) over the "
        "schedule's makespan in actions. The predicted memory holds, beside the model's, what the engine "
        "holds whatever the model: the same tiny model's resident growth less the planner's figure for it, "
        "measured once per schedule and way of running, each configuration in a launch of its own.",
    ]
    compared = [r for r in records if r["balance"] == "layers" and r["model"] != "gpt-vocab"]
    if compared:
        errors = [abs(r["step_ratio"] - 1) for r in compared]
        within = sum(error <= STEP_TOLERANCE for error in errors)
        lines += [
            "",
            f"Step time: {within} of {len(compared)} predictions within {STEP_TOLERANCE:.0%} of the measured "
            f"step (the largest error {max(errors):.1%}).",
        ]
    if compared:
        lines += [
            "",
            "| model | schedule | dtype | recompute | activations predicted | measured | error "
            "| engine's own (MiB) | memory predicted | resident growth | error | step, layers only (ms) "
            "| engine per action (ms) "
            "| step predicted (ms) | measured (ms) | error |",
            "|" + " --- |" * 16,
        ]
    for r in compared:
        p, m = r["predicted"], r["measured"]
        act_err = " / ".join(_error(a, b) for a, b in zip(p["activations"], m["activations"], strict=True))
        mem_err = " / ".join(_error(a, b) for a, b in zip(p["total"], m["rss_growth"], strict=True))
        lines.append(
            f"| {r['model']} | {r['schedule']} | {r['dtype']} | {r['recompute']} "
            f"| {' / '.join(map(_mb, p['activations']))} "
            f"| {' / '.join(map(_mb, m['activations']))} | {act_err} "
            f"| {' / '.join(map(_mb, p.get('runtime', [0] * len(p['total']))))} "
            f"| {' / '.join(map(_mb, p['total']))} "
            f"| {' / '.join(map(_mb, m['rss_growth']))} | {mem_err} | {p['layers_only_s'] * 1e3:.1f} "
            f"| {p['action_overhead_s'] * 1e3:.2f} | {p['step_s'] * 1e3:.1f} "
            f"| {m['step_s'] * 1e3:.1f} | {_step_error(r)} |"
        )
    balanced = [r for r in records if r["model"] == "gpt-vocab"]
    if len(balanced) == 2:
        by_count, by_time = balanced
        lines += [
            "",
            "## Cut by time against cut by layer count (GPT, vocab 4096, 1F1B)",
            "",
            "| balance | cut (pieces per stage) | step predicted (ms) | step measured (ms) |",
            "| --- | --- | --- | --- |",
        ]
        for r in balanced:
            cut = " + ".join(str(b - a) for a, b in r["cut"])
            lines.append(
                f"| {r['balance']} | {cut} | {r['predicted']['step_s'] * 1e3:.1f} "
                f"| {r['measured']['step_s'] * 1e3:.1f} |"
            )
        pairs = list(zip(by_count["rounds"], by_time["rounds"], strict=True))
        gain_p = 1 - statistics.median(t["predicted_s"] / c["predicted_s"] for c, t in pairs)
        steps = [(a, b) for c, t in pairs for a, b in zip(c["steps_s"], t["steps_s"], strict=True)]
        gain_m = 1 - statistics.median(b / a for a, b in steps)
        lines += [
            "",
            f"Cutting by time shortens the step by {gain_m:.1%} measured and {gain_p:.1%} predicted: the "
            f"median over {len(steps)} pairs of steps (the two pipelines step in turn, so each pair shares "
            f"the machine's state) and over {len(pairs)} profiles. The medians of each column alone swing "
            "with the machine's load; the paired figure is the one to read.",
        ]
    return "\n".join(lines) + "\n"
