"""A schedule's program timed with per-stage costs, fast: the planner's copy of the engine's simulator.

The planner simulates the same few schedules with many costs, and its steps are long (hundreds of
micro-batches through dozens of stages). ``engine.program_run.simulate_program`` interprets the lowered
program instruction by instruction; here the same rules are compiled once per schedule shape into a
flat list of compute actions in an order where every input comes first, each with what it waits for:

- the rank's previous compute (a rank runs its list in order);
- an input computed on the same rank (its end);
- an input from another rank (a message): it leaves when the sender's group (an action, or an overlapped
  pair) has ended, once the receive is posted, which the lowering does just before the group that uses
  it, i.e. when the receiver's previous compute ended; it arrives ``transfer`` later.

Replaying that list with one set of costs is a few additions and comparisons per action, in the engine
simulator's order of operations, so the times are the same floats (a test holds the two equal on every
schedule). Expert parallel's all-to-alls are charged as `pipeclock.observe.exchange` charges them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pipeclock.engine.actions import join_first_stage_backwards, placement_of
from pipeclock.engine.generators import generate

OPS = {"F": 0, "B": 1, "I": 2, "W": 3}
LONE, PAIR_FORWARD, PAIR_BACKWARD = 0, 1, 2  # how an action's duration is charged


@dataclass(frozen=True)
class Compiled:
    """One schedule shape's compute actions, ready to replay.

    ``order`` holds, per action in an order where its inputs come first, (action, previous on its rank,
    local input, second local input, remote input's sender-group end, the receiver's compute before the
    group); a missing one is ``none`` (its time is 0.0), a missing remote input -1. ``durations`` names,
    per action, a key into ``charges``: (role, stage, op, the pair partner's stage, op) for the cost."""

    ranks: int
    none: int
    order: tuple[tuple[int, int, int, int, int, int], ...]
    duration_of: tuple[int, ...]  # per action: its index in ``charges``
    charges: tuple[tuple[int, int, int, int, int], ...]
    by_rank: tuple[tuple[int, ...], ...]  # each rank's actions in program order
    stage_of: tuple[int, ...]
    op_of: tuple[int, ...]


@dataclass(frozen=True)
class Replayed:
    """What `replay` gives, in the costs' unit: makespan, bubble, and each rank's stages' moments
    (stage, its first F's start, its last backward's start and end), as ``pipeline_time.Simulated``."""

    makespan: float
    bubble: float
    moments: tuple[tuple[tuple[int, float, float, float], ...], ...]
    busy: float


@functools.lru_cache(maxsize=64)
def compiled(schedule: str, pp: int, microbatches: int, chunks: int) -> Compiled:
    """The schedule's program (first-stage backwards joined, as the engine runs it), compiled."""
    table = generate(schedule, pp, microbatches, chunks)
    return compile_table(join_first_stage_backwards(table), placement_of(table))


def compile_table(rows, placement) -> Compiled:
    """Compile ``rows`` (each rank's actions) on ``placement`` (see `Compiled`)."""
    shape = _Shape()
    for rank, actions in enumerate(rows):
        shape.add_rank(rank, actions, placement)
    none = len(shape.stage)
    queues = [
        [
            (action, previous, *shape.inputs(action, none))
            for previous, action in zip((none, *mine), mine, strict=False)
        ]
        for mine in shape.by_rank
    ]
    charges = sorted(set(shape.charge))
    position = {key: n for n, key in enumerate(charges)}
    return Compiled(
        ranks=len(rows),
        none=none,
        order=_topological(queues, none),
        duration_of=tuple(position[key] for key in shape.charge),
        charges=tuple(charges),
        by_rank=tuple(tuple(mine) for mine in shape.by_rank),
        stage_of=tuple(shape.stage),
        op_of=tuple(shape.op),
    )


class _Shape:
    """The compute actions of every rank, numbered across ranks, with what the lowering decides: the
    groups (an action, or an overlapped pair) and where each output is computed."""

    def __init__(self) -> None:
        self.stage: list[int] = []
        self.op: list[int] = []
        self.microbatch: list[int] = []
        self.rank: list[int] = []
        self.group_end: list[int] = []  # the last action of its group: its sends leave after it
        self.before_group: list[int] = []  # the rank's compute before its group: receives posted then
        self.charge: list[tuple[int, int, int, int, int]] = []
        self.by_rank: list[list[int]] = []
        self.where: dict[tuple[int, int, int], int] = {}  # (F or B, stage, micro-batch) -> action
        self.backward_stages: set[int] = set()

    def add_rank(self, rank: int, actions, placement) -> None:
        mine, index, previous = [], 0, -1
        while index < len(actions):
            size = 2 if actions[index].overlap and index + 1 < len(actions) else 1
            first = len(self.stage)
            for action in actions[index : index + size]:
                number, stage, op = len(self.stage), placement.stage(rank, action.chunk), OPS[action.op]
                self.stage.append(stage)
                self.op.append(op)
                self.microbatch.append(action.microbatch)
                self.rank.append(rank)
                self.group_end.append(first + size - 1)
                self.before_group.append(previous)
                if op != 3:  # an I gives what a B gives: the input's gradient
                    self.where.setdefault((min(op, 1), stage, action.microbatch), number)
                if op in (1, 2):
                    self.backward_stages.add(stage)
                mine.append(number)
            self._charge(list(range(first, first + size)))
            previous = first + size - 1
            index += size
        self.by_rank.append(mine)

    def _charge(self, group: list[int]) -> None:
        """Each action's duration key: alone, or the halves of an overlapped pair (F then B or I)."""
        if len(group) == 2 and self.op[group[0]] == 0 and self.op[group[1]] in (1, 2):
            first, second = group
            self.charge.append((PAIR_FORWARD, self.stage[first], 0, self.stage[second], self.op[second]))
            self.charge.append((PAIR_BACKWARD, self.stage[second], self.op[second], self.stage[first], 0))
            return
        for n in group:
            self.charge.append((LONE, self.stage[n], self.op[n], 0, 0))

    def inputs(self, action: int, none: int) -> tuple[int, int, int, int]:
        """(local input, second local input, remote input's sender-group end, the compute after which
        the receive is posted) for ``action``: the engine's `_needs`."""
        stage, op, microbatch = self.stage[action], self.op[action], self.microbatch[action]
        needs = []
        if op == 3:  # W: its own I
            needs.append(self.where[(1, stage, microbatch)])
        elif op == 0:
            if stage > 0:
                needs.append(self.where[(0, stage - 1, microbatch)])
        else:
            needs.append(self.where[(0, stage, microbatch)])
            if stage + 1 in self.backward_stages:  # past the last stage the loss is the backward's own
                needs.append(self.where[(1, stage + 1, microbatch)])
        local = [n for n in needs if self.rank[n] == self.rank[action]]
        remote = [self.group_end[n] for n in needs if self.rank[n] != self.rank[action]]
        local += [none] * (2 - len(local))
        posted = self.before_group[action] if self.before_group[action] >= 0 else none
        return local[0], local[1], remote[0] if remote else -1, posted


def _topological(queues: list[list[tuple]], none: int) -> tuple:
    """Every rank's actions in one order where each comes after all it waits for (a round robin over
    the ranks, as the engine's simulator runs them); ValueError for a schedule that cannot finish."""
    done = [False] * (none + 1)
    done[none] = True
    positions = [0] * len(queues)
    order: list[tuple] = []
    moved = True
    while moved:
        moved = False
        for q, queue in enumerate(queues):
            at = positions[q]
            while at < len(queue):
                action, _, local, second, remote, _ = queue[at]
                if not (done[local] and done[second] and (remote < 0 or done[remote])):
                    break
                order.append(queue[at])
                done[action] = True
                at += 1
                moved = True
            positions[q] = at
    if len(order) != none:
        raise ValueError("the schedule deadlocks")
    return tuple(order)


def replay(program: Compiled, costs: tuple, transfer: float) -> Replayed:
    """Time ``program`` with per-stage ``costs`` (F, B, I, W, and optionally the all-to-alls inside F and
    inside B or I) and ``transfer`` per message: the engine simulator's rules (the module's list)."""
    charges = [_duration(key, costs) for key in program.charges]
    duration = [charges[k] for k in program.duration_of]
    size = program.none + 1
    start, end = [0.0] * size, [0.0] * size
    for action, previous, local, second, remote, posted in program.order:
        t = end[previous]
        x = end[local]
        if x > t:
            t = x
        x = end[second]
        if x > t:
            t = x
        if remote >= 0:
            x, p = end[remote], end[posted]
            x = (x if x >= p else p) + transfer
            if x > t:
                t = x
        start[action] = t
        end[action] = t + duration[action]
    return _summary(program, start, end)


def _summary(program: Compiled, start: list[float], end: list[float]) -> Replayed:
    makespan, busy, moments = 0.0, 0.0, []
    stage_of, op_of = program.stage_of, program.op_of
    for mine in program.by_rank:
        first, last = {}, {}
        for action in mine:
            busy += end[action] - start[action]
            if end[action] > makespan:
                makespan = end[action]
            stage, op = stage_of[action], op_of[action]
            if op == 0:
                first.setdefault(stage, start[action])
            elif op in (1, 3):
                last[stage] = (start[action], end[action])
        moments.append(tuple((s, first[s], *last[s]) for s in sorted(first)))
    bubble = 1.0 - busy / (program.ranks * makespan) if makespan else 0.0
    return Replayed(makespan, bubble, tuple(moments), busy)


def _duration(key: tuple[int, int, int, int, int], costs: tuple) -> float:
    """An action's duration: its cost, its all-to-alls charged as ``observe.exchange`` charges them (a
    lone action pays them; an overlapped pair takes the longer of its computes and its exchanges)."""
    role, stage, op, other_stage, other_op = key
    cost, sent = costs[stage][op], _exchange(costs[stage], op)
    if role == LONE:
        return (cost - sent) + sent
    other, other_sent = costs[other_stage][other_op], _exchange(costs[other_stage], other_op)
    if role == PAIR_FORWARD:
        return cost - sent
    compute, partner = cost - sent, other - other_sent
    return compute + max(0.0, other_sent + sent - partner - compute)


def _exchange(cost: tuple, op: int) -> float:
    """The all-to-all seconds inside an action of this stage: xF in F, xB in B or I, none in W."""
    if len(cost) <= 4 or op == 3:
        return 0.0
    return cost[4] if op == 0 else cost[5]
