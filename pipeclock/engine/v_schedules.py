"""Schedules on a V: rank r holds virtual stages r and 2p - 1 - r (ZB-V, DualPipeV).

A micro-batch goes down the ranks through the first leg (chunk 0 of each rank: stages 0 .. p-1), turns
on the last rank without a message (stage p - 1 to p are both on rank p - 1), and comes back up through
the second leg (chunk 1: stages p .. 2p-1) to rank 0, which computes the loss where it read the inputs.
Every rank therefore does the same work at both ends of the step: nobody waits at the start for the
whole pipe to fill before its second chunk has something to do, which shrinks the bubble that 1F1B
and interleaving leave at both ends.

Both schedules are built for at least as many micro-batches as their steady state needs, and the
actions of the padding micro-batches are then deleted (a deletion cannot create a deadlock: see
``interleaved_1f1b``; the property tests check every p <= 8, m <= 16). Each is written rank by rank
with ``_VRank``, which counts, per chunk, the micro-batches already sent forward and backward.
"""

from __future__ import annotations

import functools
from collections import deque

from pipeclock.engine.actions import Action, Schedule
from pipeclock.engine.placement import Placement


@functools.lru_cache(maxsize=1 << 16)
def _action(op: str, microbatch: int, chunk: int, overlap: bool = False) -> Action:
    """One shared object per action: actions are immutable, and a long schedule's ranks build hundreds
    of thousands of them."""
    return Action(op, microbatch, chunk, overlap=overlap)  # type: ignore[arg-type]


class _VRank:
    """One rank's list under construction: next micro-batch per (op, chunk), and I's awaiting their W."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: dict[tuple[str, int], int] = {}
        self._weights: deque[Action] = deque()

    def _take(self, kind: str, chunk: int) -> int:
        mb = self._next.get((kind, chunk), 0)
        self._next[(kind, chunk)] = mb + 1
        return mb

    def forward(self, chunk: int) -> None:
        self.actions.append(_action("F", self._take("F", chunk), chunk))

    def pair(self, forward_chunk: int, backward_chunk: int) -> None:
        """An overlapped pair: a forward of one chunk and a whole backward of the other, started together."""
        self.actions.append(_action("F", self._take("F", forward_chunk), forward_chunk, True))
        self.backward(backward_chunk)

    def backward(self, chunk: int, split: bool = False) -> None:
        """The next backward of ``chunk``: whole (``B``), or its input half (``I``, W queued)."""
        action = _action("I" if split else "B", self._take("B", chunk), chunk)
        self.actions.append(action)
        if split:
            self._weights.append(_action("W", action.microbatch, chunk))

    def weight(self, chunk: int | None = None) -> None:
        """The oldest queued W (of ``chunk``, if given), if any: per chunk, W's follow the I's order."""
        for index, queued in enumerate(self._weights):  # the first match is near the front
            if chunk is None or queued.chunk == chunk:
                del self._weights[index]
                self.actions.append(queued)
                return

    def weights_left(self, chunk: int) -> bool:
        return any(w.chunk == chunk for w in self._weights)

    def forwards_done(self, chunk: int) -> int:
        return self._next.get(("F", chunk), 0)


def _finish(rows: list[list[Action]], p: int, m: int) -> Schedule:
    """Drop the padding micro-batches' actions; the rows become a schedule on the V placement."""
    return Schedule([[a for a in row if a.microbatch < m] for row in rows], Placement.v(p))


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6): zero bubble on a V.

    Rank r warms up with 2(p - r) - 1 forwards of its first chunk, then r pairs (second chunk, first
    chunk), then p - r rounds of F, I, W on the second chunk: the micro-batches that turned on the last
    rank come back up with no bubble. In the steady state each rank runs F, I, W on each chunk in turn,
    and the cool-down runs the remaining I's first (upstream ranks wait for them) and the W's last.

    Memory: each rank holds at most about 2p activations of one chunk (p stages' worth, as 1F1B's rank
    0), and with F = I = W per chunk the step takes 6m + p - 1 chunk-times when m >= 2p: no bubble but
    the p - 1 it takes a micro-batch to reach the last rank. For m < 2p the lists are built for 2p - 1
    micro-batches and the padding removed; the simulator reports the makespan that leaves.
    """
    _check(p, m)
    n = max(2 * p - 1, m)
    return _finish([_zb_v_rank(p, r, n) for r in range(p)], p, m)


def _zb_v_rank(p: int, r: int, n: int) -> list[Action]:
    rank = _VRank()
    for _ in range(2 * (p - r) - 1):
        rank.forward(0)
    for _ in range(r):
        rank.forward(1)
        rank.forward(0)
    for _ in range(p - r):
        rank.forward(1)
        rank.backward(1, split=True)
        rank.weight()
    while rank.forwards_done(0) < n or rank.forwards_done(1) < rank.forwards_done(0):
        if rank.forwards_done(0) < n:
            rank.forward(0)
        for chunk in (0, 1):
            if chunk == 1:
                rank.forward(1)
            rank.backward(chunk, split=True)
            rank.weight()
    for _ in range(r):  # the I's first: upstream ranks wait for them
        rank.backward(0, split=True)
        rank.backward(1, split=True)
    for _ in range(p - r):
        rank.backward(0, split=True)
        rank.weight(0)
    for chunk in (1, 0):  # then every W left, the second chunk's first
        while rank.weights_left(chunk):
            rank.weight(chunk)
    return rank.actions


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto a V): overlapped forward-backward pairs.

    Rank r fills with 2(p - r - 1) forwards of its first chunk and r + 1 pairs (first, second chunk),
    then p - r - 1 rounds of I, W, F on the second chunk. The steady state pairs a forward of one chunk
    with a whole backward of the other: an ``F`` marked ``overlap``, then a ``B``. On a GPU the two run
    overlapped, one's communication hidden behind the other's compute; on a CPU they run one after the
    other, in this order, and the simulator starts the pair when both have their inputs. The drain
    turns to split backwards (I, with its W deferred) halfway through, so the last W's fill the tail.

    Memory: rank r holds up to 2p + 1 activations of one chunk at the peak, against ZB-V's 2p. The
    makespan is DualPipe's 6m + (p - 1)(F&B + B - 3W) chunk-times with F&B = F + B on a CPU (54 at
    p = 4, m = 8 with F = 1, B = 2, W = 1). It needs m >= 2p micro-batches to reach its steady state;
    for fewer the lists are built for 2p and the padding removed (a defined fallback, with a longer
    bubble).
    """
    _check(p, m)
    n = max(2 * p, m)
    return _finish([_dualpipev_rank(p, r, n) for r in range(p)], p, m)


def _dualpipev_rank(p: int, r: int, n: int) -> list[Action]:
    rank = _VRank()
    for _ in range(2 * (p - r - 1)):
        rank.forward(0)
    for _ in range(r + 1):
        rank.forward(0)
        rank.forward(1)
    for _ in range(p - r - 1):
        rank.backward(1, split=True)
        rank.weight()
        rank.forward(1)
    for i in range(n - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # the last rank's first pair would wait for itself: run it apart
            rank.forward(0)
            rank.backward(1)
        else:
            rank.pair(0, 1)
        rank.pair(1, 0)
    for _ in range(p - r - 1):
        rank.backward(1)
        rank.pair(1, 0)
    _dualpipev_drain(rank, p, r)
    return rank.actions


def _dualpipev_drain(rank: _VRank, p: int, r: int) -> None:
    """The last backwards: whole until halfway through the rank's last r + 1, split from then on."""
    split, half = False, (r + 1) // 2
    for i in range(r + 1):
        split = split or (i == half and r % 2 == 1)
        rank.backward(1, split)
        split = split or (i == half and r % 2 == 0)
        rank.backward(0, split)
    for _ in range(p - r - 1):
        rank.weight()
        rank.backward(0, split)
    for _ in range(r + 1):
        rank.weight()


def _check(p: int, m: int) -> None:
    for name, value in (("stages", p), ("micro-batches", m)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"number of {name} must be an integer >= 1, got {value!r}")
