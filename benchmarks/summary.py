"""From every rank's step samples to one case's figures (on rank 0).

Step time is wall time across the ranks: from the earliest rank's start to the latest rank's end (the
ranks share one clock, and a barrier lines them up before each step). The bubble is read from the
spans exactly as for any ``Timeline``: 1 - compute / (ranks x makespan). Peaks are per rank.

Other people's processes share the machine. Each step records how busy the whole machine was; minus our
ranks' own CPU time, that is the foreign load of the step (``benchmarks.load``), as a share of all cores.
Steps under ``load.QUIET`` are quiet; medians over quiet steps (and pairs) are kept beside the plain ones.
"""

from __future__ import annotations

import statistics

from benchmarks import load
from benchmarks.engines import StepSample
from benchmarks.plan import Case
from pipeclock.engine.generators import bubble_formula
from pipeclock.observe.timeline import Timeline

Samples = dict[str, list[StepSample]]  # engine name -> one rank's samples, the checked step first


def foreign_share(step: tuple[StepSample, ...], wall: float) -> float | None:
    """The share of the machine's cores that processes other than our ranks used during ``step``."""
    busy = step[0].machine_busy_s
    if busy is None or wall <= 0:
        return None
    return max(0.0, busy - sum(s.cpu_s for s in step)) / (load.cores() * wall)


def quiet_median(values: list[float], shares: list[float | None]) -> float | None:
    quiet = [v for v, share in zip(values, shares, strict=True) if share is not None and share < load.QUIET]
    return statistics.median(quiet) if quiet else None


def engine_figures(per_rank: list[list[StepSample]], case: Case) -> dict:
    """The figures of one engine from each rank's samples (index 0 is the checked, untimed step)."""
    timed = list(zip(*(samples[1:] for samples in per_rank), strict=True))
    timelines = [
        Timeline([span for s in step for span in s.spans], len(per_rank), case.chunks) for step in timed
    ]
    step_s = [max(s.end for s in step) - min(s.start for s in step) for step in timed]
    shares = [foreign_share(step, wall) for step, wall in zip(timed, step_s, strict=True)]
    return {
        "step_s": step_s,
        "median_s": statistics.median(step_s),
        "foreign_share": shares,
        "quiet_median_s": quiet_median(step_s, shares),
        "bubble": [t.bubble_share for t in timelines],
        "bubble_median": statistics.median(t.bubble_share for t in timelines),
        "wait_share": [
            statistics.fmean(s.wait_s / d for s, d in zip(samples[1:], step_s, strict=True))
            for samples in per_rank
        ],
        "cpu_s": [statistics.median(s.cpu_s for s in samples[1:]) for samples in per_rank],
        "compute_ms": _compute_per_op(timelines),
        "busy_s": [statistics.median(t.busy(r) for t in timelines) for r in range(len(per_rank))],
        "peak_activation_bytes": [
            _max_known(s.peak_activation_bytes for s in samples) for samples in per_rank
        ],
        "peak_rss_bytes": [max(s.peak_rss_bytes for s in samples[1:]) for samples in per_rank],
        "step_rss_growth_bytes": [
            max(s.peak_rss_bytes - s.start_rss_bytes for s in samples[1:]) for samples in per_rank
        ],
    }


def _compute_per_op(timelines: list[Timeline]) -> dict[str, float]:
    """Mean compute time of one F, B and W (all ranks and steps), in ms: the engine's per-action cost."""
    by_op: dict[str, list[float]] = {}
    for span in (span for t in timelines for span in t.spans):
        by_op.setdefault(span.action.op, []).append(span.compute * 1e3)
    return {op: statistics.fmean(values) for op, values in sorted(by_op.items())}


def _max_known(values) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def case_result(case: Case, gathered: list[Samples], check: dict) -> dict:
    """One JSON-ready record: the case, the correctness check, and each engine's figures."""
    engines = {name: engine_figures([rank[name] for rank in gathered], case) for name in gathered[0]}
    return {
        "kind": "case",
        **case.to_dict(),
        "chunks": case.chunks,
        "torch_schedule": case.torch_schedule,
        "target": case.is_target,
        "bubble_formula": bubble_formula(case.schedule, case.stages, case.microbatches, case.chunks),
        "check": check,
        "engines": engines,
        "ratio": paired_ratio(engines),
        "quiet_ratio": quiet_paired_ratio(engines),
    }


def paired_ratio(engines: dict[str, dict]) -> float | None:
    """Median over rounds of pipeclock's step / torch's step taken right after it.

    Each pair ran back to back, so a slow spell of the machine mostly hits both halves of a pair; the
    ratio of each pair is steadier than the ratio of the two medians.
    """
    if "torch" not in engines:
        return None
    pairs = zip(engines["pipeclock"]["step_s"], engines["torch"]["step_s"], strict=True)
    return statistics.median(ours / theirs for ours, theirs in pairs)


def quiet_paired_ratio(engines: dict[str, dict]) -> float | None:
    """``paired_ratio`` over the pairs whose two steps were both quiet (None when there are none)."""
    if "torch" not in engines:
        return None
    ours, theirs = engines["pipeclock"], engines["torch"]
    quiet = [
        a / b
        for a, b, x, y in zip(
            ours["step_s"], theirs["step_s"], ours["foreign_share"], theirs["foreign_share"], strict=True
        )
        if x is not None and y is not None and max(x, y) < load.QUIET
    ]
    return statistics.median(quiet) if quiet else None
