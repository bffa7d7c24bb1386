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
    group); a missing one is ``none`` (its time is 0.0), a missing remote input -1. ``duration_of``
    names, per action, a key into ``charges``: (role, stage, op, the pair partner's stage, op).
    A compiled program of 200,000 actions holds tens of MB: `compiled` keeps 16."""

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


@functools.lru_cache(maxsize=4)
def schedule_table(schedule: str, pp: int, microbatches: int, chunks: int):
    """The generator's table, kept a while: a search reads a configuration's memory and then its step off
    the same one. The caller must not change it."""
    return generate(schedule, pp, microbatches, chunks)


@functools.lru_cache(maxsize=16)
def compiled(schedule: str, pp: int, microbatches: int, chunks: int) -> Compiled:
    """The schedule's program (first-stage backwards joined, as the engine runs it), compiled."""
    table = schedule_table(schedule, pp, microbatches, chunks)
    return compile_table(join_first_stage_backwards(table), placement_of(table))


def compile_table(rows, placement) -> Compiled:
    """Compile ``rows`` (each rank's actions) on ``placement`` (see `Compiled`)."""
    shape = _numbered(rows, placement)
    none = len(shape["stage"])
    met = shape["charges"]  # each charge once, numbered as first met
    charges = sorted(met)
    final = [0] * len(met)
    for n, key in enumerate(charges):
        final[met[key]] = n
    return Compiled(
        ranks=len(rows),
        none=none,
        order=_topological(_waits(shape, none), none),
        duration_of=tuple([final[k] for k in shape["charge"]]),
        charges=tuple(charges),
        by_rank=tuple(tuple(mine) for mine in shape["by_rank"]),
        stage_of=tuple(shape["stage"]),
        op_of=tuple(shape["op"]),
    )


def _numbered(rows, placement) -> dict:
    """Every rank's compute actions numbered across ranks, with what the lowering decides for each:
    its group (an action, or an overlapped pair: sends leave after the group's last, receives are
    posted after the rank's compute before it), how its duration is charged (a number in ``charges``,
    as first met), where outputs come from (``made``: by micro-batch, stage, and 0 for F or 1 for B or
    I, as one number, `_made_key`)."""
    stage, op, microbatch, rank_of, group_end, before, charge, by_rank = ([] for _ in range(8))
    virtual = placement.num_virtual
    made: dict[int, int] = {}
    charges: dict[tuple[int, int, int, int, int], int] = {}
    lone: dict[int, int] = {}  # a lone action's charge number, by stage and op
    for rank, actions in enumerate(rows):
        first, count, stages = len(stage), len(actions), placement.stages[rank]
        numbers = range(first, first + count)
        kinds = [OPS[action.op] for action in actions]
        where = [stages[action.chunk] for action in actions]
        batches = [action.microbatch for action in actions]
        stage += where
        op += kinds
        microbatch += batches
        rank_of += [rank] * count
        by_rank.append(numbers)
        if any(action.overlap for action in actions):
            _grouped(actions, first, kinds, where, group_end, before, charge, charges)
        else:  # each action its own group
            group_end += numbers
            before += [-1, *numbers[:-1]] if count else []
            for s, k in zip(where, kinds, strict=True):
                number = lone.get(s * 4 + k)
                if number is None:
                    number = lone[s * 4 + k] = charges.setdefault((LONE, s, k, 0, 0), len(charges))
                charge.append(number)
        for k, s, b, n in zip(kinds, where, batches, numbers, strict=True):
            if k != 3:
                key = ((b * virtual + s) << 1) | (k != 0)  # `_made_key`, inline: a call costs
                if key not in made:  # the first wins: an I gives what a B gives, the input's gradient
                    made[key] = n
    backward_stages = {(key >> 1) % virtual for key in made if key & 1}
    return {"stage": stage, "op": op, "microbatch": microbatch, "rank": rank_of, "group_end": group_end,
            "before": before, "charge": charge, "charges": charges, "by_rank": by_rank, "made": made,
            "backward_stages": backward_stages, "virtual": virtual}  # fmt: skip


def _made_key(microbatch: int, stage: int, backward: bool, virtual: int) -> int:
    """(micro-batch, stage, F or backward) as one number: a dict of numbers is quicker than of tuples."""
    return ((microbatch * virtual + stage) << 1) | backward


def _grouped(actions, first: int, kinds, where, group_end, before, charge, charges) -> None:
    """One rank's groups where overlapped pairs (an F marked ``overlap`` and the action after it) occur."""
    index, previous, count = 0, -1, len(actions)
    while index < count:
        size = 2 if actions[index].overlap and index + 1 < count else 1
        end = first + index + size - 1
        group_end += [end] * size
        before += [previous] * size
        if size == 2 and kinds[index] == 0 and kinds[index + 1] in (1, 2):
            partner, kind = where[index + 1], kinds[index + 1]
            keys = [
                (PAIR_FORWARD, where[index], 0, partner, kind),
                (PAIR_BACKWARD, partner, kind, where[index], 0),
            ]
        else:
            keys = [(LONE, where[n], kinds[n], 0, 0) for n in range(index, index + size)]
        charge += [charges.setdefault(key, len(charges)) for key in keys]
        previous = end
        index += size


def _waits(shape: dict, none: int) -> list[list[tuple]]:
    """Per rank, each action with what it waits for: (action, the rank's previous action, local input,
    second local input, remote input's sender-group end or -1, the compute after which its receive is
    posted): the engine's `_needs`, a missing one ``none``."""
    stage, op, microbatch, rank_of = shape["stage"], shape["op"], shape["microbatch"], shape["rank"]
    group_end, before, made, backward = (
        shape["group_end"],
        shape["before"],
        shape["made"],
        shape["backward_stages"],
    )
    virtual = shape["virtual"]
    queues = []
    for mine in shape["by_rank"]:
        queue, previous = [], none
        append = queue.append
        for action in mine:
            s, kind = stage[action], op[action]
            key = (microbatch[action] * virtual + s) << 1  # `_made_key` of this stage's F; + 1: its backward
            if kind == 0:  # F: the stage before's output
                own, other = none, made[key - 2] if s > 0 else none
            elif kind == 3:  # W: its own I
                own, other = made[key + 1], none
            else:  # B or I: its own forward, and the gradient from the stage after (past the last: none)
                own, other = made[key], made[key + 3] if s + 1 in backward else none
            remote = -1
            if other != none and rank_of[other] != rank_of[action]:
                other, remote = none, group_end[other]
            posted = before[action]
            append((action, previous, own, other, remote, posted if posted >= 0 else none))
            previous = action
        queues.append(queue)
    return queues


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
