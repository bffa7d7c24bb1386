"""The clock-cycle simulator: run any schedule on paper and get the timeline it would produce.

It runs the schedule's program, what the engine runs (``pipeclock.engine.program``): each rank works
through its instructions in order; a compute starts once the rank is free and its inputs exist; a
message leaves once its send and its receive are both posted and takes ``comm_latency + bytes /
bandwidth``. Nothing else is modelled: no memory limit, no overlap of a rank with itself. That is
enough to predict a schedule's bubble and activation memory, and to prove it cannot hang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipeclock.engine.actions import Action, Schedule, num_chunks, validate
from pipeclock.engine.program import DeadlockError, Instruction, lower
from pipeclock.engine.program_run import simulate_program
from pipeclock.observe.exchange import charged
from pipeclock.observe.timeline import Span, Timeline

__all__ = ["DEFAULT_COSTS", "DeadlockError", "Link", "default_costs", "simulate"]

# A whole backward costs twice a forward; split, each half costs one: F + B = F + I + W.
DEFAULT_COSTS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def default_costs(schedule: Schedule | None = None) -> dict[str, float]:
    """F = 1 and B = 2 per action; a split backward costs I = 1 and W = 1 (the same total work)."""
    return dict(DEFAULT_COSTS)


Costs = Mapping[str, float] | Callable[[int, Action], float]


@dataclass(frozen=True)
class Link:
    """What a message between two ranks costs: ``latency`` seconds, plus its bytes over ``bandwidth``
    (bytes per second; None: free). ``python -m pipeclock lab 3`` measures both on a machine."""

    latency: float = 0.0
    bandwidth: float | None = None


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    comm_latency: float = 0.0,
    bandwidth: float | None = None,
    message_bytes: Callable[[Instruction], float] | None = None,
    exchange: Callable[[int, Action], float] | None = None,
) -> Timeline:
    """The timeline of ``schedule``'s program when each op costs ``costs[op]`` and each message
    ``comm_latency`` plus ``message_bytes(send) / bandwidth``.

    ``costs`` may name only some ops; the others keep `default_costs`. It may also be a function
    ``(rank, action) -> cost``, for stages that differ (a cut by layer count of unequal layers). The
    program is the one attached to a schedule read from a ``compute_comms`` file, else the lowering's.
    ``exchange(rank, action)``: expert parallel's all-to-all seconds inside an action, charged on top of
    its cost and hidden in overlapped pairs (`pipeclock.observe.exchange`).
    Raises ``ValueError`` for a malformed schedule and `DeadlockError` for one that can never finish.
    """
    num_stages, num_microbatches, chunks = _shape(schedule)
    validate(schedule, num_stages, num_microbatches, chunks)
    durations = costs if callable(costs) else _fixed(_durations(schedule, costs))
    if comm_latency < 0:
        raise ValueError(f"comm_latency must be >= 0, got {comm_latency}")
    if bandwidth is not None and bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    programs = getattr(schedule, "programs", None) or lower(schedule)
    if exchange is not None:
        durations = charged(programs, durations, exchange)[0]
    run = simulate_program(
        programs,
        lambda rank, instruction: durations(rank, instruction.action),
        comm_latency,
        bandwidth,
        message_bytes or (lambda _send: 0.0),
    )
    spans = [
        Span(rank, instruction.action, start, end)
        for rank, ran in enumerate(run.spans)
        for instruction, start, end in ran
        if instruction.is_compute
    ]
    return Timeline(spans, num_ranks=num_stages, chunks=chunks)


def _shape(schedule: Schedule) -> tuple[int, int, int]:
    """(stages, micro-batches, chunks) as the schedule itself states them."""
    if not schedule:
        raise ValueError("a schedule needs at least one rank")
    microbatches = 1 + max((a.microbatch for actions in schedule for a in actions), default=-1)
    if microbatches == 0:
        raise ValueError("the schedule has no actions")
    return len(schedule), microbatches, num_chunks(schedule)


def _durations(schedule: Schedule, costs: Mapping[str, float] | None) -> dict[str, float]:
    durations = default_costs(schedule)
    for op, cost in (costs or {}).items():
        if op not in durations:
            raise ValueError(f"unknown op {op!r} in costs; ops are {', '.join(durations)}")
        if cost < 0:
            raise ValueError(f"cost of {op} must be >= 0, got {cost}")
        durations[op] = float(cost)
    return durations


def _fixed(durations: dict[str, float]) -> Callable[[int, Action], float]:
    return lambda _rank, action: durations[action.op]
