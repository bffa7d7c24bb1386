"""Schedule generators: pure functions from (stages, micro-batches[, chunks]) to per-rank action lists.

A generator decides only the *order* in which each rank performs its compute actions. When an action can
actually run follows from that order and from the data-flow rules in `pipeclock.engine.actions`, so the
simulator, the diagrams and a real run all derive their timing from the same lists.

Every generator keeps each channel first-in first-out: on every rank and chunk, the F's appear in
increasing micro-batch order, and so do the B's and the W's. The orchestrator relies on it to match
tensors received from a neighbour with the action that consumes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from pipeclock.engine.actions import Action, Schedule
from pipeclock.engine.v_schedules import dualpipev, zb_v


def naive(p: int, m: int) -> Schedule:
    """Stop-and-wait: every rank runs F0 B0 F1 B1 ...

    The lists look harmless, but the data flow forces micro-batch j through the whole pipe and back
    before any rank may start micro-batch j + 1: only one rank is ever busy.
    """
    _check_sizes(p, m)
    return [[Action(op, mb) for mb in range(m) for op in ("F", "B")] for _ in range(p)]


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (fill, then drain): all forwards in micro-batch order, then all backwards.

    Simple and bubble-efficient for large m, but every rank holds all m activations at the peak.
    """
    _check_sizes(p, m)
    forwards = [Action("F", mb) for mb in range(m)]
    backwards = [Action("B", mb) for mb in range(m)]
    return [forwards + backwards for _ in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): a warm-up of forwards, a steady state of (F, B) pairs, a cool-down of B's.

    Rank r warms up with min(p - r - 1, m) forwards: the ones it has time for while micro-batch 0 still
    travels through the p - r - 1 ranks after it. From then on each new forward is paid for by a
    backward, so rank r never holds more than min(m, p - r) activations, instead of GPipe's m. The
    bubble is the same as GPipe's.
    """
    _check_sizes(p, m)
    forwards = [Action("F", mb) for mb in range(m)]
    backwards = [Action("B", mb) for mb in range(m)]
    return [_one_forward_one_backward(forwards, backwards, min(p - rank - 1, m)) for rank in range(p)]


def interleaved_1f1b(p: int, m: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): each rank holds ``chunks`` model chunks.

    Rank r's chunk c is virtual stage c * p + r, so an activation visits every rank ``chunks`` times. The
    bubble shrinks by a factor ``chunks`` (each trip through the pipe costs 1/chunks of a stage) at the
    price of ``chunks`` times more messages.

    Micro-batches are taken in rounds of p. Within a round, a rank runs chunk 0 for each micro-batch of
    the round, then chunk 1, and so on; backwards use the same rounds with the chunks reversed. Rank r
    warms up with 2 * (p - r - 1) + (chunks - 1) * p forwards (capped at the total). The first backward
    is micro-batch 0 on the last chunk, which the forward order reaches only after (chunks - 1) * p
    forwards of earlier chunks; while that micro-batch's forward travels down to the last rank and its
    gradient travels back up to rank r, rank r has time for about 2 * (p - r - 1) more. Then the rank
    alternates one forward and one backward, and finally drains the remaining backwards.

    When p does not divide m, the last round is short, and applying the warm-up formula to the short
    round can deadlock (p=5, m=7, chunks=2 does). So the lists are built for m rounded up to a multiple
    of p, where every round is full, and the actions of the padding micro-batches are then deleted.
    Deleting actions cannot create a deadlock: the remaining actions keep their relative order on
    every rank and their data dependencies (which never involve another micro-batch), so a cycle of
    waits among them would already be a cycle in the padded lists, which have none (Megatron's
    full-round case; the property tests check it). What remains runs the micro-batches in rounds of p
    with a shorter last round, and the padding's deleted actions simply shorten the warm-up there.

    With one chunk this is exactly `one_f_one_b`.
    """
    _check_sizes(p, m, chunks)
    if chunks == 1:
        return one_f_one_b(p, m)
    padded = -(-m // p) * p
    rounds = [range(start, start + p) for start in range(0, padded, p)]
    forwards = [Action("F", mb, c) for rnd in rounds for c in range(chunks) for mb in rnd]
    backwards = [Action("B", mb, c) for rnd in rounds for c in reversed(range(chunks)) for mb in rnd]
    rows = [
        _one_forward_one_backward(
            forwards, backwards, min(2 * (p - rank - 1) + (chunks - 1) * p, len(forwards))
        )
        for rank in range(p)
    ]
    return [[action for action in row if action.microbatch < m] for row in rows]


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with the backward split.

    I computes only the gradient with respect to the stage's input, which the upstream rank is waiting
    for; W computes the weight gradients, which nobody waits for. Rank r keeps 1F1B's order of F's and
    backwards (as I's) and runs W(j) right after I(j + r): the later ranks, which in 1F1B sit idle at
    the end while the gradients travel back to rank 0, postpone r weight-gradient steps into that idle
    tail. The last W's (those with j + r > m - 1) close the list. With F = I = W the step takes
    3m + p - 1 instead of 1F1B's 3(m + p - 1) when m >= p: a third of 1F1B's bubble.

    Memory: a micro-batch's activations stay live from the start of its F until its W finishes. Rank r
    has at most min(m, p - r) micro-batches between F and I (as in 1F1B) plus at most r between I and
    W, so no rank ever holds more than p: the same peak as 1F1B's rank 0, which is what sets the
    memory a pipeline must be sized for.
    """
    _check_sizes(p, m)
    rows = [[Action("I", a.microbatch) if a.op == "B" else a for a in row] for row in one_f_one_b(p, m)]
    return [_defer_weight_gradients(row, delay=rank, m=m) for rank, row in enumerate(rows)]


def _one_forward_one_backward(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then alternate the next forward and the oldest backward, then the rest."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for i in range(steady):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[steady:]


def _defer_weight_gradients(row: list[Action], delay: int, m: int) -> list[Action]:
    """Insert W(j) right after I(j + delay); the W's that no I follows go last, in order."""
    order: list[Action] = []
    for action in row:
        order.append(action)
        if action.op == "I" and action.microbatch >= delay:
            order.append(Action("W", action.microbatch - delay))
    return order + [Action("W", mb) for mb in range(max(0, m - delay), m)]


def _check_sizes(p: int, m: int, chunks: int = 1) -> None:
    for name, value in (("stages", p), ("micro-batches", m), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"number of {name} must be an integer >= 1, got {value!r}")


Generator = Callable[..., Schedule]

SCHEDULES: dict[str, Generator] = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
}
# Generators that fix the chunks per rank themselves: a V gives rank r stages r and 2p - 1 - r.
_FIXED_CHUNKS: dict[Generator, int] = {zb_v: 2, dualpipev: 2}
V_SCHEDULES = tuple(name for name, generator in SCHEDULES.items() if generator in _FIXED_CHUNKS)

_BUBBLE_FORMULAS: dict[str, tuple[str, Callable[[int, int, int], float]]] = {
    "naive": ("(p-1)/p", lambda p, m, v: (p - 1) / p),
    "gpipe": ("(p-1)/(m+p-1)", lambda p, m, v: (p - 1) / (m + p - 1)),
    "1f1b": ("(p-1)/(m+p-1)", lambda p, m, v: (p - 1) / (m + p - 1)),
    "interleaved-1f1b": ("(p-1)/(v*m+p-1)", lambda p, m, v: (p - 1) / (v * m + p - 1)),
    "zb-h1": ("(p-1)/(3m+p-1)", lambda p, m, v: (p - 1) / (3 * m + p - 1)),
    "zb-v": ("(p-1)/(6m+p-1)", lambda p, m, v: (p - 1) / (6 * m + p - 1)),
    "dualpipev": ("(p-1)/(3m+p-1)", lambda p, m, v: (p - 1) / (3 * m + p - 1)),
}

# Where a formula is exact with the default costs: it counts a full steady state, which these schedules
# reach only with enough micro-batches (the generators' docstrings say why).
_FORMULA_ASSUMES: dict[str, tuple[str, Callable[[int, int, int], bool]]] = {
    "interleaved-1f1b": ("m a multiple of p", lambda p, m, v: v == 1 or m % p == 0),
    "zb-h1": ("m ≥ p", lambda p, m, v: m >= p),
    "zb-v": ("m ≥ 2p", lambda p, m, v: m >= 2 * p),
    "dualpipev": ("m ≥ 2p", lambda p, m, v: m >= 2 * p),
}


def get_schedule(name: str) -> Generator:
    """The generator called ``name`` on the command line, e.g. ``"1f1b"``."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}") from None


def supports_chunks(generator: Generator) -> bool:
    """True when ``generator`` interleaves, i.e. takes a ``chunks`` parameter."""
    return "chunks" in inspect.signature(generator).parameters


def chunks_of(name: str) -> int | None:
    """The chunks per rank a schedule fixes (2 on a V), or None when the user chooses (interleaving)."""
    return _FIXED_CHUNKS.get(get_schedule(name))


def generate(name_or_generator: str | Generator, p: int, m: int, chunks: int = 1) -> Schedule:
    """Call any generator the same way; ``chunks`` > 1 is an error for a one-chunk schedule."""
    generator = get_schedule(name_or_generator) if isinstance(name_or_generator, str) else name_or_generator
    _check_sizes(p, m, chunks)
    fixed = _FIXED_CHUNKS.get(generator)
    if fixed is not None:
        if chunks != fixed:
            raise ValueError(f"schedule {_name_of(generator)!r} is a V: two chunks per rank, not {chunks}")
        return generator(p, m)
    if supports_chunks(generator):
        return generator(p, m, chunks=chunks)
    if chunks > 1:
        raise ValueError(
            f"schedule {_name_of(generator)!r} has one chunk per rank; cannot use chunks={chunks}"
        )
    return generator(p, m)


def bubble_formula(name: str, p: int, m: int, chunks: int = 1) -> float:
    """The textbook bubble of schedule ``name``, as a share of the step, with the default costs.

    Default costs are F = 1, B = 2 per stage (F = B = W = 1 when the backward is split), each of an
    interleaved rank's chunks costing 1/chunks of that.
    """
    _check_sizes(p, m, chunks)
    get_schedule(name)
    return _BUBBLE_FORMULAS[name][1](p, m, chunks)


def formula_assumption(name: str, p: int, m: int, chunks: int = 1) -> str | None:
    """What `bubble_formula` assumes that ``(p, m, chunks)`` does not give (``"m ≥ 2p"`` for ZB-V with
    m = 4 on 4 ranks), or None where the formula is exact: then only the simulated bubble is right."""
    get_schedule(name)
    text, holds = _FORMULA_ASSUMES.get(name, ("", lambda p, m, v: True))
    return None if holds(p, m, chunks) else text


def bubble_formula_text(name: str) -> str:
    """The formula of `bubble_formula` as text, e.g. ``"(p-1)/(m+p-1)"`` (v is the number of chunks)."""
    get_schedule(name)
    return _BUBBLE_FORMULAS[name][0]


def _name_of(generator: Generator) -> str:
    names = [name for name, known in SCHEDULES.items() if known is generator]
    return names[0] if names else getattr(generator, "__name__", repr(generator))
