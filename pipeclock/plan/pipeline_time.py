"""A step's pipeline on paper: a floor on its time without simulating it, and the schedule's program
simulated with per-stage costs (expert parallel's all-to-alls hidden where a paired action allows).

``cluster_time`` turns a configuration into those costs.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from pipeclock.engine.actions import join_first_stage_backwards, placement_of
from pipeclock.engine.generators import V_SCHEDULES, generate
from pipeclock.engine.program import lower
from pipeclock.engine.program_run import simulate_program
from pipeclock.observe.simulate import simulate
from pipeclock.plan.cluster_config import Config
from pipeclock.plan.cluster_memory import placement_for
from pipeclock.plan.pipeline_replay import compiled, replay

# The simulated program takes each cost to three significant digits (`_round`), which moves a cost by at
# most half a unit of its third digit: 0.5 % of it. A floor held against a simulated step reads each cost
# that much lower, and each all-to-all it takes off that much higher (`as_simulated_at_least`), or a
# configuration could be dropped for a floor above the step it would have taken.
ROUNDING = 0.005


def as_simulated_at_least(seconds: float, hidden: float = 0.0) -> float:
    """The least ``seconds - hidden`` can be once the simulated program has rounded both (`ROUNDING`)."""
    return (1 - ROUNDING) * seconds - (1 + ROUNDING) * hidden


def pipeline_floor(config: Config, costs: list[dict[str, float]], transfer: float) -> float:
    """A time no program of this schedule can beat, as the planner simulates it (its costs rounded:
    `as_simulated_at_least`), without simulating it: the larger of

    - for each rank, its work after the forwards that must reach its first stage before it can start,
      and (a schedule that runs whole backwards, ending each rank on its first stage's last backward)
      before the gradient from there has gone back to the first stage;
    - the last stage's m forwards and backwards, after the first micro-batch's forward has reached it
      and before the last one's gradient has gone back to the first stage (each hop across ranks costing
      at least one message).
    """
    return shape_floor(config.schedule, config.pp, config.chunks, config.microbatches, costs, transfer)


def shape_floor(schedule: str, pp: int, chunks: int, m: int, costs: list[dict[str, float]], transfer: float):
    """`pipeline_floor` of the schedule's shape, with no configuration to build (a search asks often)."""
    (ranks, chain, chain_per_microbatch), busiest_at = _floor_terms(schedule, pp, chunks, costs)
    busiest = busiest_at.get(m)
    if busiest is None:
        busiest = busiest_at[m] = max(fixed + m * per_microbatch for fixed, per_microbatch in ranks)
    transfer = as_simulated_at_least(transfer)
    return max(busiest, chain + m * chain_per_microbatch + 2 * (pp - 1) * transfer)


_FLOOR_TERMS: dict[tuple, tuple] = {}


def _floor_terms(schedule: str, pp: int, chunks: int, costs: list[dict[str, float]]) -> tuple:
    """`pipeline_floor`'s terms, linear in the micro-batch count: per rank (what precedes and follows
    its work, its work per micro-batch), and the last stage's chain (fixed, per micro-batch); with a
    dict for the busiest rank's time by micro-batch count. Kept while ``costs`` (a list `stage_costs`
    caches) lives."""
    shape = _floor_shape(schedule, pp, chunks)
    key = (id(costs), id(shape))  # schedules that split alike on the same placement share their terms
    cached = _FLOOR_TERMS.get(key)
    if cached is not None and cached[0] is costs and cached[1] is shape:
        return cached[2:]
    terms = _floor_terms_of(shape, costs)
    if len(_FLOOR_TERMS) > 4096:
        _FLOOR_TERMS.clear()
    _FLOOR_TERMS[key] = (costs, shape, terms, {})
    return terms, _FLOOR_TERMS[key][3]


def _floor_terms_of(shape: tuple[bool, tuple], costs: list[dict[str, float]]) -> tuple:
    """The terms for ``costs`` as simulated at least, without their all-to-alls (which may hide under a
    paired action)."""
    split, stages_of = shape
    forward = [as_simulated_at_least(cost["F"], cost.get("xF", 0.0)) for cost in costs]
    backward = [as_simulated_at_least(cost["B"], cost.get("xB", 0.0)) for cost in costs]
    gradient = (
        [as_simulated_at_least(cost["I"], cost.get("xB", 0.0)) for cost in costs] if split else backward
    )
    before = list(itertools.accumulate(forward, initial=0.0))
    after = [0.0] * len(before) if split else list(itertools.accumulate(backward, initial=0.0))
    work = [f + b for f, b in zip(forward, backward, strict=True)]
    ranks = tuple(
        (before[min(stages)] + after[min(stages)], sum(work[s] for s in stages)) for stages in stages_of
    )
    last = len(costs) - 1
    chain = sum(forward[s] + gradient[s] for s in range(last))
    return ranks, chain, forward[last] + gradient[last]


@functools.lru_cache(maxsize=1024)
def _floor_shape(schedule: str, pp: int, chunks: int) -> tuple[bool, tuple]:
    """Whether the schedule splits its backwards, and each rank's virtual stages: one object for equal
    shapes, which `_floor_terms` tells apart by identity."""
    shape = (
        splits_backward(schedule),
        tuple(tuple(stages) for stages in placement_for(schedule, pp, chunks).stages),
    )
    return _SHAPES.setdefault(shape, shape)


_SHAPES: dict[tuple, tuple] = {}


@functools.lru_cache(maxsize=64)
def splits_backward(schedule: str) -> bool:
    """Whether the schedule splits each backward into I and W (the zero-bubble family)."""
    return any(
        action.op == "I" for actions in generate(schedule, 2, 2, chunks_for(schedule)) for action in actions
    )


def chunks_for(schedule: str) -> int:
    return 2 if schedule in V_SCHEDULES or schedule == "interleaved-1f1b" else 1


def _round(value: float) -> float:
    """Three significant digits: costs that differ less share one simulation."""
    return float(f"{value:.3g}")


@dataclass(frozen=True)
class Simulated:
    """What a search needs from a simulated step, in the costs' unit: its makespan and bubble, and for
    each rank its stages' moments: (stage, its first F's start, its last backward's start and end)."""

    makespan: float
    bubble: float
    moments: tuple[tuple[tuple[int, float, float, float], ...], ...]


@functools.lru_cache(maxsize=8192)
def simulated(schedule: str, pp: int, microbatches: int, chunks: int, costs: tuple, transfer: float):
    """The schedule's program simulated with per-stage ``costs`` (F, B, I, W, and the all-to-alls inside
    F and inside B or I) and each message costing ``transfer``, in the costs' unit; cached: a search asks
    for the same ones often. `pipeclock.plan.pipeline_replay` runs the engine simulator's rules on the
    program compiled once per shape (`engine_simulated` is the engine's own run, which it equals)."""
    run = replay(compiled(schedule, pp, microbatches, chunks), costs, transfer)
    return Simulated(run.makespan, run.bubble, run.moments)


def engine_simulated(schedule: str, pp: int, microbatches: int, chunks: int, costs: tuple, transfer: float):
    """`simulated` by the engine's own simulator on the lowered program: the reference it is held to."""
    if any(len(stage) > 4 and (stage[4] or stage[5]) for stage in costs):
        return _simulated_exchanging(schedule, pp, microbatches, chunks, costs, transfer)
    programs, stages = _program(schedule, pp, microbatches, chunks)
    ops = {"F": 0, "B": 1, "I": 2, "W": 3}

    def cost(rank: int, instruction) -> float:
        action = instruction.action
        return costs[stages[rank][action.chunk]][ops[action.op]]

    run = simulate_program(programs, cost, transfer)
    moments, busy, makespan = [], 0.0, 0.0
    for rank in range(pp):
        first, last = {}, {}
        for instruction, start, end in run.spans[rank]:
            if not instruction.is_compute:
                continue
            busy += end - start
            makespan = max(makespan, end)
            action = instruction.action
            stage = stages[rank][action.chunk]
            if action.op == "F":
                first.setdefault(stage, start)
            elif action.op in ("B", "W"):
                last[stage] = (start, end)
        moments.append(tuple((s, first[s], *last[s]) for s in sorted(first)))
    bubble = 1.0 - busy / (pp * makespan) if makespan else 0.0
    return Simulated(makespan, bubble, tuple(moments))


def _simulated_exchanging(schedule: str, pp: int, microbatches: int, chunks: int, costs: tuple, transfer):
    """`engine_simulated` with expert parallel's all-to-alls, which the simulator may hide under a paired
    action (``observe.simulate``'s ``exchange``)."""
    table = generate(schedule, pp, microbatches, chunks)
    placement = placement_of(table)
    ops, inside = {"F": 0, "B": 1, "I": 2, "W": 3}, {"F": 4, "B": 5, "I": 5}

    def exchange(rank: int, action) -> float:
        return costs[placement.stage(rank, action.chunk)][inside[action.op]] if action.op in inside else 0.0

    def cost(rank: int, action) -> float:
        return costs[placement.stage(rank, action.chunk)][ops[action.op]] - exchange(rank, action)

    timeline = simulate(join_first_stage_backwards(table), cost, comm_latency=transfer, exchange=exchange)
    moments = []
    for rank in range(pp):
        first, last = {}, {}
        for span in timeline.spans_of(rank):
            stage = placement.stage(rank, span.action.chunk)
            if span.action.op == "F":
                first.setdefault(stage, span.start)
            elif span.action.op in ("B", "W"):
                last[stage] = (span.start, span.end)
        moments.append(tuple((s, first[s], *last[s]) for s in sorted(first)))
    return Simulated(timeline.makespan, timeline.bubble_share, tuple(moments))


@functools.lru_cache(maxsize=32)
def _program(schedule: str, pp: int, microbatches: int, chunks: int) -> tuple[list, tuple]:
    """The schedule's program as the engine runs it (first-stage backwards joined), and each rank's
    virtual stage per chunk: costs change from one simulation to the next, this does not. The table is
    a generator's, which the engine's tests hold valid; it is not checked again here."""
    table = generate(schedule, pp, microbatches, chunks)
    placement = placement_of(table)
    joined = join_first_stage_backwards(table)
    stages = tuple(tuple(placement.stage(rank, chunk) for chunk in range(chunks)) for rank in range(pp))
    return lower(joined), stages
