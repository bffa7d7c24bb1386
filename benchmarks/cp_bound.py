"""How close any cost linear in the sequence can come to torchtitan's context-parallel rows.

Along torchtitan's Tables 2 and 6 (arXiv 2410.06511) every rank keeps the same tokens (seq / cp = 32,768)
while the sequence doubles with cp. A layer's costs, per token, are then fixed (its products, elementwise
work, tp's and FSDP's collectives), proportional to cp (attention's FLOPs: the causal square over the
whole sequence; each block's shapes, hence its kernel's speed, the same at every cp), or proportional
to cp - 1 where not hidden (the ring's keys and values, torch's merges of the blocks' outputs): per-token
time ``a + b x cp`` plus something between 0 and ``g x (cp - 1)``. `smallest_error` gives the least
worst error such a model leaves on a series of published rows with ``a`` at least a floor;
`planner_floor` reads the floor and ``g`` off the planner: its per-token time at cp 1 with attention
free, and the most it then charges per added cp rank (the exchange and merges, nothing hiding them).

    python -m benchmarks.cp_bound      # the bound for Table 2's and Table 6's series
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations, pairwise

from pipeclock.plan import calibration

TARGET = 0.10  # the "within 10 %"


@dataclass(frozen=True)
class Bound:
    """The least worst error ``error`` of any ``a + b x cp`` (a at least the floor, b >= 0), and one line
    that reaches it (per-token times, in the points' unit)."""

    error: float
    a: float
    b: float


def smallest_error(points: list[tuple[float, float]], floor: float, spread: float = 0.0) -> Bound:
    """The least, over lines ``t = a + b x`` with ``a >= floor`` and ``b >= 0``, of the largest error on
    ``points`` (x, published rate), the error being a predicted rate over the published one, less 1, as
    `benchmarks.cluster_check` counts it: ``(1 / t(x)) / rate - 1``. With ``spread``, each point's time
    may also exceed the line by anything up to ``spread x (x - 1)`` (costs that grow with x - 1 but may
    hide, wholly or in part)."""
    if not points or any(x <= 0 or rate <= 0 for x, rate in points):
        raise ValueError("points must be (x > 0, rate > 0) pairs")
    low, high = 0.0, 0.999999
    if _line(points, floor, high, spread) is None:
        raise ValueError(f"no line with an intercept of at least {floor:g} comes within 100 %")
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if _line(points, floor, middle, spread) is not None else (middle, high)
    a, b = _line(points, floor, high, spread)
    return Bound(high, a, b)


def largest_floor(points: list[tuple[float, float]], error: float = TARGET, spread: float = 0.0) -> float:
    """The largest intercept floor at which some line still comes within ``error`` of every point."""
    low, high = 0.0, min(1.0 / rate for _, rate in points) / (1.0 - error)
    if _line(points, low, error, spread) is None:
        return float("nan")  # no line with a >= 0 does
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if _line(points, middle, error, spread) is not None else (low, middle)
    return low


def least_spread(points: list[tuple[float, float]], floor: float, error: float = TARGET) -> float:
    """The least ``spread`` (`smallest_error`'s) at which some line with ``a >= floor`` comes within
    ``error`` of every point."""
    low, high = 0.0, max(1.0 / rate for _, rate in points)
    if _line(points, floor, error, low) is not None:
        return 0.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if _line(points, floor, error, middle) is not None else (middle, high)
    return high


def _line(points: list[tuple[float, float]], floor: float, error: float,
          spread: float) -> tuple[float, float] | None:  # fmt: skip
    """A line (a, b) within ``error`` of every point with ``a >= floor``, ``b >= 0``, or None.

    Each point bounds the line's time at x to ``[t / (1 + error) - spread x (x - 1), t / (1 - error)]``,
    t the published time; for a given a, b then lies between the lines ``(bound - a) / x`` (and 0 below).
    The width of that interval is concave in a, so its largest value over ``a >= floor`` is at the floor
    or where two of the lines cross: those candidates are tried."""
    lower = [(x, 1.0 / rate / (1.0 + error) - spread * (x - 1)) for x, rate in points]
    upper = [(x, 1.0 / rate / (1.0 - error)) for x, rate in points]
    lines = [*lower, *upper, (None, 0.0)]  # (None, 0): the line b = 0

    def b_range(a: float) -> tuple[float, float]:
        least = max([0.0] + [(t - a) / x for x, t in lower])
        most = min((t - a) / x for x, t in upper)
        return least, most

    candidates = {floor}
    for (x1, t1), (x2, t2) in combinations(lines, 2):
        if x1 is None or x2 is None:
            crossing = t2 if x1 is None else t1  # (t - a) / x = 0
        elif x1 == x2:
            continue
        else:
            crossing = (t1 * x2 - t2 * x1) / (x2 - x1)
        if crossing >= floor:
            candidates.add(crossing)
    for a in sorted(candidates):
        least, most = b_range(a)
        if least <= most * (1 + 1e-12):
            return a, least
    return None


# --- the published series ------------------------------------------------------------------------------


def series(table: list, source: str) -> list:
    """The context-parallel series of one torchtitan table (its cp 1 row first), each row's tokens per
    rank checked to be the same."""
    chosen = sorted((row for row in table if row.source == source and ", CP " in row.name),
                    key=lambda row: row.fixed.get("cp", 1))  # fmt: skip
    per_rank = {row.job.seq_len // row.fixed.get("cp", 1) for row in chosen}
    if len(per_rank) != 1 or chosen[0].fixed.get("cp", 1) != 1:
        raise ValueError(f"{source}: not a series of one cp-1 row and rows of equal tokens per rank")
    return chosen


def planner_floor(rows: list, values: dict | None = None) -> tuple[float, float]:
    """The planner's intercept floor for ``rows`` (a `series`), seconds a token: (its fixed time, that is
    its per-token time at cp 1 with attention free, and the most it charges per added cp rank then, its
    keys' and values' traffic and merges all exposed), with `benchmarks.cluster_check`'s ``values``."""
    from benchmarks.cluster_check import predict

    share = calibration.ATTENTION_SHARE
    calibration.ATTENTION_SHARE = share * 1e9
    try:
        times = [(row.fixed.get("cp", 1), 1.0 / predict(row, values)["tokens"]) for row in rows]
    finally:
        calibration.ATTENTION_SHARE = share
    slope = max((t2 - t1) / (c2 - c1) for (c1, t1), (c2, t2) in pairwise(times))
    return times[0][1], max(slope, 0.0)


def report(table: list, values: dict | None = None) -> str:
    """The bound's lines for Table 2's and Table 6's series."""
    lines = []
    for source in ("torchtitan T2", "torchtitan T6"):
        rows = series(table, source)
        points = [(row.fixed.get("cp", 1), row.tokens) for row in rows]
        fixed, slope = planner_floor(rows, values)
        bound = smallest_error(points, fixed, slope)
        critical = largest_floor(points, TARGET, slope)
        within = (f"within {TARGET:.0%} needs a <= {critical * 1e6:,.1f} us" if critical == critical else
                  f"with any a >= 0: {smallest_error(points, 0.0, slope).error:.1%}")  # fmt: skip
        if bound.error > TARGET:
            needed = least_spread(points, fixed)
            within += f", or {needed * 1e6:,.1f} us a cp rank ({needed / slope:.1f} times)"
        lines.append(
            f"{source} cp {', '.join(str(int(x)) for x, _ in points)}: published "
            f"{', '.join(f'{1e6 / rate:,.0f}' for _, rate in points)} us a token; any a + b x cp, a at "
            f"least the planner's fixed {fixed * 1e6:,.1f} us (cp 1, attention free), plus up to "
            f"{slope * 1e6:,.1f} us a cp rank past the first (its exchange and merges, all exposed), leaves "
            f"{bound.error:.1%} on some row (a {bound.a * 1e6:,.1f}, b {bound.b * 1e6:,.1f} us); {within}"
        )
    return "\n".join(lines)


def main() -> None:
    from benchmarks.published_2024 import titan_rows

    print(report(titan_rows()))


if __name__ == "__main__":
    main()
