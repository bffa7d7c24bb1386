"""The Markdown report of a sweep: the machine, the targets, every case, zero-bubble, the engine overhead.

Every number comes from ``results_model``; with several runs a cell reads ``median [low-high]``.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Iterable

import psutil
import torch

from benchmarks.plan import SCHEDULES, TORCH_SCHEDULES
from benchmarks.results_model import Key, Results, Spread
from pipeclock import schedule as schedules
from pipeclock.observe.simulate import simulate

MIB = 1024 * 1024


# --- cells --------------------------------------------------------------------------------------------


def ms(spread: Spread | None) -> str:
    return _cell(spread, 1e3, "{:.0f}")


def ratio(spread: Spread | None) -> str:
    return _cell(spread, 1.0, "{:.3f}")


def percent(spread: Spread | None) -> str:
    return _cell(spread, 100.0, "{:.0f}%")


def _cell(spread: Spread | None, scale: float, pattern: str) -> str:
    if spread is None:
        return "n/a"
    text = pattern.format(spread.median * scale)
    if len(spread.values) > 1:
        text += f" [{pattern.format(spread.low * scale)}–{pattern.format(spread.high * scale)}]"
    return text


def per_rank_mib(values: list[int | None] | None) -> str:
    """``12.0 / 6.0``: one value per rank, in MiB."""
    if not values or any(v is None for v in values):
        return "n/a"
    return " / ".join(f"{v / MIB:.1f}" for v in values)  # type: ignore[operator]


def rss_cell(figures: dict | None) -> str:
    """``1626 (+12) / 2070 (+8)``: each rank's peak RSS in MiB, and how much of it the step itself added."""
    if not figures:
        return "n/a"
    pairs = zip(figures["peak_rss_bytes"], figures["step_rss_growth_bytes"], strict=True)
    return " / ".join(f"{peak / MIB:.0f} (+{growth / MIB:.0f})" for peak, growth in pairs)


def table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


# --- sections -----------------------------------------------------------------------------------------


def machine(results: Results, command: str, seconds: list[float]) -> list[str]:
    setups = [r for run in results.runs for r in run.of_kind("setup")]
    threads = sorted({t for s in setups for t in s["threads"]})
    took = f" (took {', '.join(f'{s / 60:.1f} min' for s in seconds)})" if seconds else ""
    memory = psutil.virtual_memory().total / 2**30
    return [
        f"- machine: {_cpu_name()}, {results.num_cores} cores, {memory:.0f} GiB, no GPU",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, gloo over loopback TCP",
        f"- intra-op threads per rank: {threads} (checked on every launch)"
        if threads
        else "- intra-op threads per rank: cores / local ranks, set by `comms.init` (unrecorded)",
        f"- command: `{command}`; runs: {len(results.runs)}{took}",
        "- cells read `median [lowest–highest]` over the runs when there is more than one run",
    ]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


CASE_HEADER = [
    "p",
    "hidden",
    "m",
    "schedule",
    "pipeclock ms",
    "torch ms",
    "pipeclock/torch",
    "ideal ms",
    "eff. pipeclock",
    "eff. torch",
    "bubble pipeclock",
    "bubble torch",
    "bubble formula",
    "act. MiB/rank pipeclock",
    "act. MiB/rank torch",
    "peak RSS MiB/rank (step's growth) pipeclock",
    "torch",
]


def case_row(results: Results, key: Key) -> list[str]:
    f, record = results.figures(key), results.record(key)
    engines = record["engines"]
    torch_engine = engines.get("torch", {})
    name = key[3] if record["torch_schedule"] else f"{key[3]} (torch: needs m ≥ p)"
    return [
        str(key[0]),
        str(key[1]),
        str(key[2]),
        name,
        ms(f["pipeclock_s"]),
        ms(f["torch_s"]),
        ratio(f["ratio"]),
        ms(f["ideal_s"]),
        percent(f["eff_pipeclock"]),
        percent(f["eff_torch"]),
        percent(f["bubble_pipeclock"]),
        percent(f["bubble_torch"]),
        f"{record['bubble_formula'] * 100:.0f}%",
        per_rank_mib(engines["pipeclock"]["peak_activation_bytes"]),
        per_rank_mib(torch_engine.get("peak_activation_bytes")),
        rss_cell(engines["pipeclock"]),
        rss_cell(engines.get("torch")),
    ]


def targets(results: Results) -> list[str]:
    """The issue's targets: two ranks, hidden 1024, m in {4, 8}; GPipe and 1F1B at <= 0.95x torch, >= 90%."""
    keys = [k for k in results.keys if results.record(k)["target"]]
    if not keys:
        return []
    lines = ["## Targets (p = 2, hidden = 1024, batch 256)", "", "All timed steps:", ""]
    lines += table(CASE_HEADER, (case_row(results, k) for k in keys))
    lines += ["", "Quiet steps only (other processes used < 5% of the machine during the step):", ""]
    lines += table(QUIET_HEADER, (quiet_row(results, k) for k in keys))
    lines += [
        "",
        *table(VERDICT_HEADER, (verdict_row(results, k) for k in keys if k[3] in ("gpipe", "1f1b"))),
    ]
    return [*lines, ""]


QUIET_HEADER = [
    "m",
    "schedule",
    "quiet pairs",
    "pipeclock ms",
    "torch ms",
    "pipeclock/torch",
    "ideal ms",
    "eff. pipeclock",
    "eff. torch",
]
VERDICT_HEADER = ["m", "schedule", "≤ 0.95× torch (all / quiet)", "≥ 90% of ideal (all / quiet)"]


def quiet_row(results: Results, key: Key) -> list[str]:
    f = results.figures(key)
    return [
        str(key[2]),
        key[3],
        str(results.quiet_pairs(key)),
        ms(f["quiet_pipeclock_s"]),
        ms(f["quiet_torch_s"]),
        ratio(f["quiet_ratio"]),
        ms(f["quiet_ideal_s"]),
        percent(f["quiet_eff_pipeclock"]),
        percent(f["quiet_eff_torch"]),
    ]


def verdict_row(results: Results, key: Key) -> list[str]:
    f = results.figures(key)

    def judged(spread: Spread | None, ok) -> str:
        return "n/a" if spread is None else ("met" if ok(spread.median) else "not met")

    fast = [judged(f[name], lambda r: r <= 0.95) for name in ("ratio", "quiet_ratio")]
    full = [judged(f[name], lambda e: e >= 0.90) for name in ("eff_pipeclock", "quiet_eff_pipeclock")]
    return [str(key[2]), key[3], " / ".join(fast), " / ".join(full)]


def baselines(results: Results) -> list[str]:
    """T1 for every (hidden, m): the one-process step with both cores busy."""
    rows = []
    for hidden, m in sorted({(k[1], k[2]) for k in results.keys}):
        records = [run.baselines[(hidden, m)] for run in results.runs if (hidden, m) in run.baselines]
        if not records:
            continue
        quiet = [r["quiet_t1_s"] for r in records if r["quiet_t1_s"] is not None]
        rows.append(
            [
                str(hidden),
                str(m),
                ms(Spread([r["t1_s"] for r in records])),
                ms(Spread(quiet) if quiet else None),
            ]
        )
    header = ["hidden", "m", "T1 ms (all steps)", "T1 ms (quiet steps)"]
    return ["## One process (T1, both cores busy)", "", *table(header, rows), ""] if rows else []


def sweep(results: Results) -> list[str]:
    lines = ["## Every case", ""]
    for p in sorted({k[0] for k in results.keys}):
        lines += [
            f"### p = {p}"
            + (f" (oversubscribed: {p} ranks on {results.num_cores} cores)" if p > results.num_cores else ""),
            "",
        ]
        lines += table(CASE_HEADER, (case_row(results, k) for k in results.keys if k[0] == p))
        lines.append("")
    return lines


def summary(results: Results) -> list[str]:
    """Per (p, schedule): the geometric mean of the ratio and the median efficiencies over hidden and m."""
    rows = []
    for p in sorted({k[0] for k in results.keys}):
        for name in SCHEDULES:
            every = [results.figures(k) for k in results.keys if k[0] == p and k[3] == name]
            figures = [f for f in every if f["torch_s"]]  # the cases both engines ran, so medians compare
            if not figures:
                continue
            rows.append(
                [
                    str(p),
                    name,
                    TORCH_SCHEDULES[name],
                    _geo_mean(f["ratio"] for f in figures),
                    _geo_mean(f["quiet_ratio"] for f in figures),
                    _median_percent(f["eff_pipeclock"] for f in figures),
                    _median_percent(f["eff_torch"] for f in figures),
                    _median_percent(f["eff_floor_pipeclock"] for f in figures),
                    _median_percent(f["eff_floor_torch"] for f in figures),
                ]
            )
    header = [
        "p",
        "schedule",
        "torch class",
        "pipeclock/torch, geo. mean (all)",
        "(quiet pairs)",
        "median eff. pipeclock",
        "median eff. torch",
        "vs max(ideal, T1/cores): pipeclock",
        "torch",
    ]
    note = "Over the cases both engines ran (torch's 1F1B refuses m < p)."
    return ["## Sweep summary (over hidden and m)", "", note, "", *table(header, rows), ""]


def _geo_mean(spreads: Iterable[Spread | None]) -> str:
    values = [s.median for s in spreads if s]
    if not values:
        return "n/a"
    return f"{statistics.geometric_mean(values):.3f} ({min(values):.2f}–{max(values):.2f})"


def _median_percent(spreads: Iterable[Spread | None]) -> str:
    values = [s.median for s in spreads if s]
    return f"{statistics.median(values) * 100:.0f}%" if values else "n/a"


def zero_bubble(results: Results) -> list[str]:
    """pipeclock's zb-h1 against its own 1F1B, measured, and as the simulator predicts from measured costs."""
    rows = []
    for p, hidden, m, name in results.keys:
        if name != "zb-h1" or (p, hidden, m, "1f1b") not in results.keys:
            continue
        zb, one = results.record((p, hidden, m, "zb-h1")), results.record((p, hidden, m, "1f1b"))
        measured = Spread(
            [
                run.cases[(p, hidden, m, "zb-h1")]["engines"]["pipeclock"]["median_s"]
                / run.cases[(p, hidden, m, "1f1b")]["engines"]["pipeclock"]["median_s"]
                for run in results.runs
                if (p, hidden, m, "zb-h1") in run.cases and (p, hidden, m, "1f1b") in run.cases
            ]
        )
        rows.append(
            [
                str(p),
                str(hidden),
                str(m),
                ratio(measured),
                f"{predicted_zb_ratio(p, m, zb, one):.3f}",
                f"{_textbook(p, m):.3f}",
            ]
        )
    if not rows:
        return []
    header = [
        "p",
        "hidden",
        "m",
        "zb-h1 / 1f1b measured",
        "predicted from measured F, B, W",
        "textbook (F = B = W)",
    ]
    return ["## Zero bubble against 1F1B (pipeclock)", "", *table(header, rows), ""]


def predicted_zb_ratio(p: int, m: int, zb: dict, one: dict) -> float:
    """The simulator's zb-h1 / 1f1b step ratio with each schedule's own measured mean F, B (and W)."""
    zb_costs = _split_costs(zb["engines"]["pipeclock"]["compute_ms"])
    one_costs = one["engines"]["pipeclock"]["compute_ms"]
    zb_span = simulate(schedules.zero_bubble_h1(p, m), zb_costs).makespan
    one_span = simulate(schedules.one_f_one_b(p, m), {op: one_costs[op] for op in ("F", "B")}).makespan
    return zb_span / one_span


def _split_costs(costs: dict[str, float]) -> dict[str, float]:
    """A split schedule's measured costs; results saved before the I op existed name the I half B."""
    return {("I" if op == "B" and "I" not in costs else op): cost for op, cost in costs.items()}


def _textbook(p: int, m: int) -> float:
    return simulate(schedules.zero_bubble_h1(p, m)).makespan / (3 * (m + p - 1))


def overhead(results: Results) -> list[str]:
    """Per schedule and engine, at hidden 16: CPU per action, the bare work, the engine's share, waits."""
    by_key: dict[tuple[str, str], list[tuple[dict, float]]] = {}
    first = None
    for run in results.runs:
        for record in run.of_kind("overhead"):
            first = first or record
            bare = statistics.fmean(record["bare_cpu_us_per_action"])
            for name, figures in record["engines"].items():
                by_key.setdefault((record["schedule"], name), []).append((figures, bare))
    if first is None:
        return []
    rows = []
    for (schedule, name), entries in by_key.items():
        rows.append(
            [
                schedule,
                name,
                _cell(_over(entries, lambda f, b: f["median_s"]), 1e3, "{:.1f}"),
                _cell(_over(entries, lambda f, b: b), 1.0, "{:.0f}"),
                _cell(_over(entries, lambda f, b: statistics.fmean(f["cpu_us_per_action"])), 1.0, "{:.0f}"),
                _cell(
                    _over(entries, lambda f, b: statistics.fmean(f["overhead_us_per_action"])), 1.0, "{:.0f}"
                ),
                " / ".join(f"{w * 100:.0f}%" for w in entries[0][0]["wait_share"]),
            ]
        )
    header = [
        "schedule",
        "engine",
        "step ms",
        "bare µs/action",
        "CPU µs/action",
        "engine µs/action",
        "blocked on messages (per rank, run 1)",
    ]
    return [
        "## Engine overhead (hidden 16: compute ~0)",
        "",
        f"p = {first['stages']}, batch {first['batch']}, m = {first['microbatches']}, {first['steps']} steps "
        "per engine; CPU µs per action averaged over ranks; engine = CPU − bare.",
        "",
        *table(header, rows),
        "",
        *profile(results),
    ]


def _over(entries: list[tuple[dict, float]], value) -> Spread:
    """``value(figures, bare)`` over the runs: one overhead figure as a spread."""
    return Spread([value(figures, bare) for figures, bare in entries])


def profile(results: Results) -> list[str]:
    """Where each engine's time goes at ~zero compute: rank 0's main thread under cProfile, by own time."""
    records = [r for r in results.runs[0].of_kind("profile")]
    lines = []
    for record in records:
        rows = [
            [f"`{f['function']}`", f"{f['calls_per_action']:.2f}", f"{f['own_us_per_action']:.1f}"]
            for f in record["functions"]
        ]
        lines += [
            f"### Where {record.get('engine', 'pipeclock')}'s time goes "
            f"({record['schedule']}, rank 0, cProfile)",
            "",
            f"{record['total_us_per_action']:.0f} µs of the main thread's CPU per action in all, profiled "
            "(waiting excluded); the functions with the most time of their own:",
            "",
            *table(["function", "calls per action", "own µs per action"], rows),
            "",
        ]
        if "parts_us_per_action" in record:
            parts = [[part, f"{us:.1f}"] for part, us in record["parts_us_per_action"].items()]
            lines += [
                "All profiled time per action, by kind:",
                "",
                *table(["kind", "µs per action"], parts),
                "",
            ]
    return lines


def markdown(results: Results, command: str, seconds: list[float]) -> str:
    lines = ["# pipeclock against torch.distributed.pipelining", ""]
    lines += [*machine(results, command, seconds), ""]
    for section in (targets, summary, zero_bubble, baselines, sweep, overhead):
        lines += section(results)
    return "\n".join(lines) + "\n"
