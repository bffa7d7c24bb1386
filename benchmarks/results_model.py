"""The records of one or more runs of a sweep, and the figures derived from them.

A run is the list of JSON records the workers wrote (``setup``, ``baseline``, ``case``, ``overhead``,
``profile``). Several runs of the same plan give a spread: each figure is reported as the median over
runs with its smallest and largest value. The derived figures, all from measurements:

- ideal step = T1 / p * (m + p - 1) / m, with T1 the one-process step of the same (hidden, m);
- the two-core floor T1 / cores: with more ranks than cores no schedule can beat it, whatever p is;
- efficiency = ideal / measured step (above 1 when a schedule beats the fill-and-drain bubble, as
  zero-bubble schedules can, or when a rank's smaller share of the weights fits the cache better).

Each figure also has a ``quiet_`` twin computed from the quiet steps only (``benchmarks.load``): T1 and
step medians over the steps during which other processes left the cores alone, and the median ratio
over the pairs whose two steps were both quiet.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from benchmarks import load
from benchmarks.plan import SCHEDULES

Key = tuple[int, int, int, str]  # (stages, hidden, micro-batches, schedule)


@dataclass
class Spread:
    """A figure over repeated runs: the median, and the smallest and largest value seen."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)


@dataclass
class Run:
    """One run of a sweep: its records, indexed."""

    records: list[dict]
    baselines: dict[tuple[int, int], float] = field(init=False)
    cases: dict[Key, dict] = field(init=False)

    def __post_init__(self) -> None:
        self.baselines = {
            (r["hidden"], r["microbatches"]): r for r in self.records if r["kind"] == "baseline"
        }
        self.cases = {
            (r["stages"], r["hidden"], r["microbatches"], r["schedule"]): r
            for r in self.records
            if r["kind"] == "case"
        }

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]


def ideal_seconds(t1: float, p: int, m: int) -> float:
    """The fill-and-drain ideal: T1 shared by p ranks, plus (p - 1) of m + p - 1 slots of bubble."""
    return t1 / p * (m + p - 1) / m


def derived(case: dict, baseline: dict | None, num_cores: int) -> dict[str, float | None]:
    """One case's figures in one run: step times, ratio, ideal and efficiencies (all steps, and quiet)."""
    engines = case["engines"]
    figures = {
        "ratio": case.get("ratio"),
        "quiet_ratio": case.get("quiet_ratio"),
        "bubble_pipeclock": engines["pipeclock"]["bubble_median"],
        "bubble_torch": engines["torch"]["bubble_median"] if "torch" in engines else None,
    }
    for prefix, step_field, t1_field in (
        ("", "median_s", "t1_s"),
        ("quiet_", "quiet_median_s", "quiet_t1_s"),
    ):
        t1 = baseline.get(t1_field) if baseline else None
        ideal = ideal_seconds(t1, case["stages"], case["microbatches"]) if t1 else None
        best = max(ideal, t1 / num_cores) if ideal and t1 else None
        figures[prefix + "ideal_s"] = ideal
        for name in ("pipeclock", "torch"):
            step = engines[name].get(step_field) if name in engines else None
            figures[f"{prefix}{name}_s"] = step
            figures[f"{prefix}eff_{name}"] = ideal / step if ideal and step else None
            figures[f"{prefix}eff_floor_{name}"] = best / step if best and step else None
    return figures


def _schedule_order(name: str) -> int:
    return SCHEDULES.index(name) if name in SCHEDULES else len(SCHEDULES)


class Results:
    """Several runs of one plan; figures per case as spreads over the runs."""

    def __init__(self, runs: list[Run], num_cores: int | None = None):
        self.runs = runs
        self.num_cores = num_cores or load.cores()
        keys = {key for run in runs for key in run.cases}
        self.keys: list[Key] = sorted(keys, key=lambda k: (k[0], k[1], k[2], _schedule_order(k[3])))

    def baseline(self, run: Run, hidden: int, m: int) -> dict | None:
        """The T1 record from this run, or from any run that measured it."""
        found = run.baselines.get((hidden, m))
        if found is None:
            found = next((r.baselines[(hidden, m)] for r in self.runs if (hidden, m) in r.baselines), None)
        return found

    def figures(self, key: Key) -> dict[str, Spread | None]:
        """Every derived figure of case ``key``, as a spread over the runs that measured it."""
        per_run = [
            derived(run.cases[key], self.baseline(run, key[1], key[2]), self.num_cores)
            for run in self.runs
            if key in run.cases
        ]
        spreads = {}
        for name in per_run[0]:
            values = [f[name] for f in per_run if f[name] is not None]
            spreads[name] = Spread(values) if values else None
        return spreads

    def record(self, key: Key) -> dict:
        """The case record of the first run that measured ``key`` (for memory and the check)."""
        return next(run.cases[key] for run in self.runs if key in run.cases)

    def quiet_pairs(self, key: Key) -> int:
        """How many pairs of steps of case ``key`` were quiet on both sides, over all runs."""
        count = 0
        for run in self.runs:
            engines = run.cases[key]["engines"] if key in run.cases else {}
            if "torch" in engines:
                shares = zip(
                    engines["pipeclock"]["foreign_share"], engines["torch"]["foreign_share"], strict=True
                )
                count += sum(
                    1 for a, b in shares if a is not None and b is not None and max(a, b) < load.QUIET
                )
        return count
