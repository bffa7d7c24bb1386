"""Following the ranks of one ``lab N --check`` launch, and the verdict when something is wrong.

The ranks (`check_rank`) report every call, every forward and backward, every fault. The watcher keeps,
per rank, what it did last, what it waits for, and the actions of its current step; it raises `Verdict`
at the first fault (the earliest cause among those reported by the time every rank has ended, finished
or waits for what no one has sent it, or ``RESULTS_LIMIT`` after the first; of exceptions that several
ranks' code raised, the lowest rank's, whichever the machine ran first), when every rank's step is over
and one of them left the schedule (`order`), at a deadlock (no rank moved for ``STALL`` seconds once all
had started), or when a process is lost. A fault that a wrong order explains says so.
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeclock.course.check_rank import ORDER, PEER, RESULT, Fault
from pipeclock.course.order import Lab, divergence, drawn, held_beyond, kept_beyond, listed
from pipeclock.course.rank_state import RankState
from pipeclock.course.stuck import deadlock
from pipeclock.engine.actions import Action

STALL = 4.0  # seconds without any rank completing a call, all ranks started: a deadlock
SILENCE = 60.0  # seconds without any report at all, whatever the ranks do: a loop that never ends
START_LIMIT = 120.0  # seconds for the processes to start and load the file
RESULTS_LIMIT = 5.0  # seconds to wait, after a fault, for every rank to be quiet and have its results
GRACE = 0.5  # seconds to let faults found at about the same moment arrive, however quiet the ranks


class Verdict(Exception):
    """The check's answer when something is wrong: ``str`` is the paragraph to print."""


@dataclass
class Watch:
    """One launch of ``world`` ranks checking ``lab_of(m)``'s order for each case."""

    world: int
    lab_of: Callable[[int], Lab]
    states: list[RankState] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    first_at: float | None = None

    def __post_init__(self) -> None:
        self.states = [RankState() for _ in range(self.world)]

    def ran(self, m: int) -> dict[int, list[Action]]:
        return {rank: state.ran.get(m, []) for rank, state in enumerate(self.states)}

    def kept(self, m: int) -> list[int]:
        """What each rank held at most in its step with ``m`` micro-batches, measured."""
        return [state.kept.get(m, 0) for state in self.states]

    def follow(self, kind: str, rank: int, case, rest: list, now: float) -> None:
        state = self.states[rank]
        if kind == "fault":
            self.add(rest[0], now)
        elif kind == "lost":
            where = "" if case is not None else " before its first step"
            text = f"rank {rank} stopped{where}: {rest[0]}"
            self.add(Fault(rank, case or _Nowhere(10**6), PEER, now, text, True), now)
        elif kind == "started":
            state.started = True
        elif kind == "finished":
            state.finished = True
        elif kind == "begin":
            state.m, state.did, state.waits = case.m, "started its step", None
            state.ran[case.m] = []
            state.sent, state.received = Counter(), Counter()
        elif kind == "message":
            state.message(*rest)
        elif kind == "computed":
            state.ran.setdefault(case.m, []).append(Action(*rest[0]))
        elif kind == "did":
            state.did, state.waits = rest[0], None
        elif kind == "waits":
            state.waits = rest[0]
        elif kind == "held":
            state.kept[case.m] = rest[0]
        elif kind == "checked":
            state.checked.add(case.m)
        elif kind == "step done":
            state.did, state.waits = "finished its step", None
            state.done.add(case.m)
            if all(case.m in s.done for s in self.states):
                self.check_order(case.m, now)

    def settled(self, now: float, quiet: bool) -> bool:
        """Whether the earliest fault can be named: ``GRACE`` after the first one, once every rank is
        ``quiet`` (waits in a call, has finished or has ended: it can find nothing more by itself) and,
        when the fault is a result checked at the step's end, every rank has checked its own; or
        ``RESULTS_LIMIT`` after the first fault, whatever the ranks do."""
        if now - self.first_at <= GRACE:
            return False
        if now - self.first_at > RESULTS_LIMIT:
            return True
        first = min(self.faults, key=lambda f: f.order)
        return quiet and (first.tier != RESULT or all(first.case.m in s.checked for s in self.states))

    def add(self, fault: Fault, now: float) -> None:
        self.faults.append(fault)
        self.first_at = self.first_at if self.first_at is not None else now

    def check_order(self, m: int, now: float) -> None:
        """Every rank's step with ``m`` micro-batches is over: its order and what it held, to the schedule."""
        lab = self.lab_of(m)
        ran = self.ran(m)
        found = divergence(lab, ran, complete=True)
        if found is None:
            kept = kept_beyond(lab, self.kept(m))
            if kept:
                self.add(Fault(kept[0], _Nowhere(m), ORDER, now, kept[1]), now)
            return
        lines = [found[1]]
        more = held_beyond(lab, ran)
        if more:
            lines.append(f"  {more}")
        yours = [ran[rank] for rank in range(self.world)]
        lines += beside(lab, yours)
        self.add(Fault(found[0][1], _Nowhere(m), ORDER, now, "\n".join(lines)), now)

    def verdict(self) -> str:
        """The paragraph for the earliest fault; a wrong order it follows from is added below it."""
        first = min(self.faults, key=lambda f: f.order)
        if first.tier == ORDER:
            return first.text if first.text.startswith("wrong memory") else f"wrong order: {first.text}"
        if isinstance(first.case, _Nowhere):
            return f"wrong, with {self.world} ranks: {first.text}"
        text = f"wrong, with {self.world} ranks and m = {first.case.m}: {first.text}"
        m = first.case.m
        ended = frozenset(rank for rank, state in enumerate(self.states) if m in state.done)
        found = divergence(self.lab_of(m), self.ran(m), complete=False, ended=ended)
        if found and first.symptom:  # the order is the cause, what was seen follows from it
            return f"wrong order: {found[1]}\n  what followed, with {self.world} ranks: {first.text}"
        if found:
            return text + f"\n  it follows from the order: {found[1]}"
        followed = (
            so_far(self.lab_of(m), first.rank, self.ran(m).get(first.rank, [])) if first.raised else None
        )
        return text + (f"\n  {followed}" if followed else "")


@dataclass(frozen=True)
class _Nowhere:
    """The case of a fault that no rank's case names (an order found by the watcher, a lost process)."""

    m: int


def so_far(lab: Lab, rank: int, done: list[Action]) -> str | None:
    """Where ``rank``'s order stood when its own code raised, while it still followed the schedule: the
    exception came before the loop computed anything out of order, so the order cannot be blamed, but
    what the schedule runs next (and why) is often what the loop was not about to do."""
    want = lab.rows()[rank]
    if not done or done != want[: len(done)] or len(done) >= len(want):
        return None  # nothing computed yet (an unwritten exercise), or the order already left
    ran, k = " ".join(map(str, done)), len(done)
    return (
        f"until then rank {rank} followed the order of {lab.title} ({ran}); the schedule runs {want[k]} next "
        f"({lab.why(rank, k)})"
    )


def beside(lab: Lab, yours: list[list[Action]]) -> list[str]:
    """The learner's order drawn above the schedule's, as `pipeclock schedule` draws (F = 1, B = 2)."""
    head = "your loop's order, drawn as `pipeclock schedule` draws one (F = 1, B = 2; dots are idle):"
    mine = drawn(yours) or listed(yours)
    theirs = drawn(lab.rows()) or listed(lab.rows())
    return [head, mine, f"{lab.name}'s order for the same p and m:", theirs]


def watch(processes, events, world: int, lab_of: Callable[[int], Lab]) -> Watch:
    """Follow the ranks until all finish; `Verdict` at the first fault, a deadlock or a lost process."""
    seen = Watch(world, lab_of)
    states = seen.states
    started_at, moved_at = time.monotonic(), None
    while not all(state.finished for state in states) or seen.faults:
        reports = queued(events)  # all of them: a rank is judged by what it last said
        now = time.monotonic()
        for kind, rank, case, *rest in reports:
            seen.follow(kind, rank, case, rest, now)
        if reports and all(state.started for state in states):
            moved_at = now  # any report is news: a rank that starts to wait was busy until then
        if seen.faults and all_stopped(states, processes):
            drain(seen, events, now)  # what the stopped ranks said before they ended counts too
            raise Verdict(seen.verdict())
        if seen.faults and seen.settled(now, quiet(states, processes)):
            raise Verdict(seen.verdict())
        if seen.faults:
            continue
        lost = [r for r, p in enumerate(processes) if not p.is_alive() and not states[r].finished]
        if lost and not reports:
            code = processes[lost[0]].exitcode
            raise Verdict(f"rank {lost[0]} ended without finishing (exit code {code}), with {world} ranks")
        if moved_at is not None and now - moved_at > STALL and stuck(states):
            raise Verdict(deadlock(seen.states, seen.lab_of, now - moved_at))
        if moved_at is not None and now - moved_at > SILENCE:  # a rank computes forever
            raise Verdict(deadlock(seen.states, seen.lab_of, now - moved_at, "no progress"))
        if moved_at is None and now - started_at > START_LIMIT:
            raise Verdict(f"the {world} processes did not all start within {START_LIMIT:g}s")
    return seen


def queued(events, wait: float = 0.1) -> list:
    """The reports waiting in ``events``, after waiting up to ``wait`` seconds for the first."""
    try:
        reports = [events.get(timeout=wait)]
    except queue.Empty:
        return []
    while True:
        try:
            reports.append(events.get_nowait())
        except queue.Empty:
            return reports


def drain(seen: Watch, events, now: float) -> None:
    """Follow every report still queued: a process flushes its reports before it ends, so once all have
    stopped, what is queued is all there is."""
    while reports := queued(events):
        for kind, rank, case, *rest in reports:
            seen.follow(kind, rank, case, rest, now)


def stuck(states: list[RankState]) -> bool:
    """Every rank waits, and one of them in the learner's loop: ranks that all wait between steps are
    only slow to get there (a busy machine), never stuck."""
    return all(state.blocked for state in states) and any(state.in_loop for state in states)


def quiet(states: list[RankState], processes) -> bool:
    """No rank will move by itself: each has ended, has finished, or waits in a call and not for a
    message already sent to it."""
    return all(
        not process.is_alive() or (state.blocked and not _delivered(states, rank))
        for rank, (state, process) in enumerate(zip(states, processes, strict=True))
    )


def _delivered(states: list[RankState], rank: int) -> bool:
    """Whether the message ``rank`` waits to receive has been sent: it will move on."""
    receiving = states[rank].receiving
    if receiving is None:
        return False
    peer, tag, _ = receiving
    return states[peer].sent[rank, tag] > states[rank].received[peer, tag]


def all_stopped(states: list[RankState], processes) -> bool:
    return all(not p.is_alive() or s.finished for s, p in zip(states, processes, strict=True))
