"""The decode loop as a schedule: for each rank, the ordered forwards it runs, and what they wait for.

Generation cuts the prompts into groups. One forward, ``Decode(group, token)``, computes token ``token``
of every prompt of ``group`` through the rank's stage. Every rank runs the same order, token by token and
within a token group by group:

    rank r:  (g0, t0) (g1, t0) ... (gG-1, t0) (g0, t1) (g1, t1) ...

and the dependencies are those of a forward-only pipeline closed into a ring:

- ``(g, t)`` on rank r > 0 needs the hidden states of ``(g, t)`` from rank r - 1;
- ``(g, t)`` on rank 0, for t > 0, needs the bytes sampled by ``(g, t - 1)`` on the last rank.

A group's next token cannot start before its last one has gone round every stage: with one group the
ring holds one piece of work and p - 1 of p ranks wait (decoding's own bubble). With G >= p groups each
rank always has another group's token to compute while one travels: the ring is kept full.
``simulate`` predicts the timeline from these rules alone, for ``docs/benchmarks.md`` and ``--png``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeclock.engine.actions import Action
from pipeclock.observe.timeline import Span, Timeline


@dataclass(frozen=True, slots=True)
class Decode:
    """Token ``token`` of every prompt in group ``group``, through one rank's stage."""

    group: int
    token: int

    def as_action(self) -> Action:
        """The training IR's forward of micro-batch ``group``: how timelines and diagrams draw it."""
        return Action("F", self.group)


def decode_schedule(num_stages: int, num_groups: int, tokens: int) -> list[list[Decode]]:
    """Each rank's forwards, in the order it runs them (the same order on every rank)."""
    order = [Decode(group, token) for token in range(tokens) for group in range(num_groups)]
    return [list(order) for _ in range(num_stages)]


def needs(rank: int, step: Decode, num_stages: int) -> tuple[int, Decode] | None:
    """The (rank, forward) whose message ``step`` on ``rank`` waits for; None for a prompt's prefill."""
    if rank > 0:
        return rank - 1, step
    if step.token > 0:
        return num_stages - 1, Decode(step.group, step.token - 1)
    return None


def simulate(
    schedule: list[list[Decode]], compute: float | Sequence[float] = 1.0, message: float = 0.0
) -> Timeline:
    """The timeline the dependencies allow when a forward of group g costs ``compute[g]`` (or
    ``compute`` for every group) and every message ``message`` (a ring of one rank passes its bytes to
    itself for free)."""
    num_stages = len(schedule)
    cost = (lambda g: compute) if isinstance(compute, int | float) else (lambda g: compute[g])
    done: dict[tuple[int, Decode], float] = {}
    clock, cursor, spans = [0.0] * num_stages, [0] * num_stages, []
    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule):
            while cursor[rank] < len(actions):
                step = actions[cursor[rank]]
                need = needs(rank, step, num_stages)
                if need is not None and need not in done:
                    break
                ready = 0.0 if need is None else done[need] + (message if need[0] != rank else 0.0)
                start = max(clock[rank], ready)
                clock[rank] = done[(rank, step)] = start + cost(step.group)
                spans.append(Span(rank, step.as_action(), start, clock[rank]))
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the decode schedule waits in a cycle: no rank can go on")
    return Timeline(spans, num_stages)
