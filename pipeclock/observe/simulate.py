"""The clock-cycle simulator: run any schedule on paper and get the timeline it would produce.

Each rank works through its list in order and starts each action as soon as the rank is free and the
action's inputs exist (the rules of `pipeclock.engine.actions.dependencies`), an input from another rank
arriving ``comm_latency`` after it was produced. Nothing else is modelled: no bandwidth, no memory
limit, no overlap of a rank with itself. That is enough to predict a schedule's bubble and activation
memory, and to prove it cannot hang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pipeclock.engine.actions import (
    Action,
    Schedule,
    dependencies,
    num_chunks,
    placement_of,
    produces,
    validate,
)
from pipeclock.engine.program import DeadlockError
from pipeclock.observe.timeline import Span, Timeline

__all__ = ["DEFAULT_COSTS", "DeadlockError", "default_costs", "simulate"]

# A whole backward costs twice a forward; split, each half costs one: F + B = F + I + W.
DEFAULT_COSTS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def default_costs(schedule: Schedule | None = None) -> dict[str, float]:
    """F = 1 and B = 2 per action; a split backward costs I = 1 and W = 1 (the same total work)."""
    return dict(DEFAULT_COSTS)


Costs = Mapping[str, float] | Callable[[int, Action], float]


def simulate(schedule: Schedule, costs: Costs | None = None, comm_latency: float = 0.0) -> Timeline:
    """The timeline of ``schedule`` when each op costs ``costs[op]`` and each hop ``comm_latency``.

    ``costs`` may name only some ops; the others keep `default_costs`. It may also be a function
    ``(rank, action) -> cost``, for stages that differ (a cut by layer count of unequal layers). Raises
    ``ValueError`` for a malformed schedule and `DeadlockError` for one that can never finish.
    """
    num_stages, num_microbatches, chunks = _shape(schedule)
    validate(schedule, num_stages, num_microbatches, chunks)
    durations = costs if callable(costs) else _fixed(_durations(schedule, costs))
    if comm_latency < 0:
        raise ValueError(f"comm_latency must be >= 0, got {comm_latency}")
    run = _Run(schedule, durations, comm_latency)
    run.until_stuck()
    if not run.finished:
        raise DeadlockError(run.deadlock_report())
    return Timeline(run.spans, num_ranks=num_stages, chunks=chunks)


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


class _Run:
    """The simulation state: where each rank is in its list, when it is free, what has finished."""

    def __init__(self, schedule: Schedule, durations: Callable[[int, Action], float], latency: float) -> None:
        self.schedule = schedule
        self.durations = durations
        self.latency = latency
        self.placement = placement_of(schedule)
        self.position = [0] * len(schedule)
        self.free_at = [0.0] * len(schedule)
        self.done: dict[tuple[int, Action], float] = {}
        self.spans: list[Span] = []

    @property
    def finished(self) -> bool:
        return all(pos == len(actions) for pos, actions in zip(self.position, self.schedule, strict=True))

    def until_stuck(self) -> None:
        """Advance every rank as far as its inputs allow, again and again, until nothing moves."""
        moved = True
        while moved:
            moved = False
            for rank in range(len(self.schedule)):
                while self._try_next(rank):
                    moved = True

    def _try_next(self, rank: int) -> bool:
        """Start the rank's next action (or overlapped pair) if its inputs exist; False if it must wait."""
        position, actions = self.position[rank], self.schedule[rank]
        if position == len(actions):
            return False
        group = actions[position : position + (2 if actions[position].overlap else 1)]
        ready = self._inputs_ready(rank, group)
        if ready is None:
            return False
        start = max(self.free_at[rank], ready)
        for action in group:
            end = start + self.durations(rank, action)
            self.spans.append(Span(rank, action, start, end))
            for event in produces(action):
                self.done[(rank, event)] = end
            start = end
        self.free_at[rank] = start
        self.position[rank] += len(group)
        return True

    def _inputs_ready(self, rank: int, group: list[Action]) -> float | None:
        """When every input of ``group`` has arrived, or None if one has not been produced yet."""
        ready = 0.0
        for action in group:
            for needed in self._needs(rank, action):
                if needed[1] in group and needed[0] == rank:
                    continue  # produced inside the pair itself
                if needed not in self.done:
                    return None
                hop = self.latency if needed[0] != rank else 0.0
                ready = max(ready, self.done[needed] + hop)
        return ready

    def _needs(self, rank: int, action: Action) -> list[tuple[int, Action]]:
        return dependencies(action, rank, self.placement)

    def deadlock_report(self) -> str:
        lines = ["the schedule deadlocks; no rank can move:"]
        for rank, actions in enumerate(self.schedule):
            if self.position[rank] == len(actions):
                lines.append(f"  rank {rank}: finished")
                continue
            action = actions[self.position[rank]]
            missing = [_event(r, a) for r, a in self._needs(rank, action) if (r, a) not in self.done]
            lines.append(
                f"  rank {rank}: stuck at {action} (action {self.position[rank]}), "
                f"waiting for {' and '.join(missing)}"
            )
        return "\n".join(lines)


def _event(rank: int, event: Action) -> str:
    """A missing event, as a reader wants it: a gradient comes from a B, or from an I."""
    what = f"{event} (or I{str(event)[1:]})" if event.op == "B" else str(event)
    return f"{what} on rank {rank}"
