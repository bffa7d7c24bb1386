"""The clock-cycle simulator: run any schedule on paper and get the timeline it would produce.

Each rank works through its list in order and starts each action as soon as the rank is free and the
action's inputs exist (the rules of `pipeclock.engine.actions.dependencies`), an input from another rank
arriving ``comm_latency`` after it was produced. Nothing else is modelled: no bandwidth, no memory
limit, no overlap of a rank with itself. That is enough to predict a schedule's bubble and activation
memory, and to prove it cannot hang.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeclock.engine.actions import Action, Schedule, dependencies, is_split, num_chunks, validate
from pipeclock.observe.timeline import Span, Timeline

UNSPLIT_COSTS: dict[str, float] = {"F": 1.0, "B": 2.0, "W": 0.0}
SPLIT_COSTS: dict[str, float] = {"F": 1.0, "B": 1.0, "W": 1.0}


class DeadlockError(RuntimeError):
    """The schedule can never finish: every unfinished rank waits for something that cannot happen."""


def default_costs(schedule: Schedule) -> dict[str, float]:
    """F = 1, B = 2 per action; when the backward is split, F = B = W = 1 (the same total work)."""
    return dict(SPLIT_COSTS if is_split(schedule) else UNSPLIT_COSTS)


def simulate(
    schedule: Schedule, costs: Mapping[str, float] | None = None, comm_latency: float = 0.0
) -> Timeline:
    """The timeline of ``schedule`` when each op costs ``costs[op]`` and each hop ``comm_latency``.

    ``costs`` may name only some ops; the others keep `default_costs`. Raises ``ValueError`` for a
    malformed schedule and `DeadlockError` for one that can never finish.
    """
    num_stages, num_microbatches, chunks = _shape(schedule)
    validate(schedule, num_stages, num_microbatches, chunks)
    durations = _durations(schedule, costs)
    if comm_latency < 0:
        raise ValueError(f"comm_latency must be >= 0, got {comm_latency}")
    run = _Run(schedule, durations, comm_latency, num_virtual=num_stages * chunks)
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


class _Run:
    """The simulation state: where each rank is in its list, when it is free, what has finished."""

    def __init__(
        self, schedule: Schedule, durations: dict[str, float], latency: float, num_virtual: int
    ) -> None:
        self.schedule = schedule
        self.durations = durations
        self.latency = latency
        self.num_virtual = num_virtual
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
        if self.position[rank] == len(self.schedule[rank]):
            return False
        action = self.schedule[rank][self.position[rank]]
        inputs_ready = 0.0
        for needed in self._needs(rank, action):
            if needed not in self.done:
                return False
            hop = self.latency if needed[0] != rank else 0.0
            inputs_ready = max(inputs_ready, self.done[needed] + hop)
        start = max(self.free_at[rank], inputs_ready)
        end = start + self.durations[action.op]
        self.spans.append(Span(rank, action, start, end))
        self.done[(rank, action)] = end
        self.free_at[rank] = end
        self.position[rank] += 1
        return True

    def _needs(self, rank: int, action: Action) -> list[tuple[int, Action]]:
        return dependencies(action, rank, len(self.schedule), self.num_virtual)

    def deadlock_report(self) -> str:
        lines = ["the schedule deadlocks; no rank can move:"]
        for rank, actions in enumerate(self.schedule):
            if self.position[rank] == len(actions):
                lines.append(f"  rank {rank}: finished")
                continue
            action = actions[self.position[rank]]
            missing = [f"{a} on rank {r}" for r, a in self._needs(rank, action) if (r, a) not in self.done]
            lines.append(
                f"  rank {rank}: stuck at {action} (action {self.position[rank]}), "
                f"waiting for {' and '.join(missing)}"
            )
        return "\n".join(lines)
