"""``pipeclock lab N --check FILE``: run a learner's schedule loop on real processes and say what is wrong.

For 2 and then 4 ranks, one launch of gloo processes runs the learner's function for several micro-batch
counts (fewer micro-batches than ranks among them) against the one-process model
(`check_rank`). The answer is one paragraph in plain words: all good, with the bubble measured
beside the formula; or the first thing wrong: a message or a gradient that differs (which rank, which
micro-batch, forward or backward, by how much), a wrong loss, an exception (its line in the learner's
file), or a deadlock: no rank moved for ``STALL`` seconds once all had started, and each rank's last
completed call and the call it waits in are named. The processes are always killed before the answer.
"""

from __future__ import annotations

import multiprocessing
import queue
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeclock.course.check_rank import Case, Fault, load_function, run_rank
from pipeclock.engine.generators import bubble_formula, bubble_formula_text

STALL = 4.0  # seconds without any rank completing a call, all ranks started: a deadlock
SILENCE = 60.0  # seconds without any report at all, whatever the ranks do: a loop that never ends
START_LIMIT = 120.0  # seconds for the processes to start and load the file
BETWEEN_STEPS = "for the others to"  # how a rank waiting between two steps says so
GRACE = 0.5  # seconds to let faults found at about the same moment arrive, to report the earliest


@dataclass(frozen=True)
class Exercise:
    """A lab's loop: the function a learner writes, and the schedule it implements."""

    lab: int
    function: str
    schedule: str
    chunks: int = 1

    def cases(self, world: int) -> list[Case]:
        counts = {2: [1, 3], 4: [2, 5]}[world]  # m < p, uneven splits of 11; then m = 2p, timed too
        return [Case(m) for m in counts] + [Case(2 * world, hidden=256, batch=256, timed=True)]


EXERCISES = {
    4: Exercise(4, "naive_step", "naive"),
    5: Exercise(5, "gpipe_step", "gpipe"),
    6: Exercise(6, "one_f_one_b_step", "1f1b"),
    7: Exercise(7, "interleaved_step", "interleaved-1f1b", chunks=2),
}
RANK_COUNTS = (2, 4)


@dataclass
class RankState:
    started: bool = False
    finished: bool = False
    did: str = "nothing yet"
    waits: str | None = None
    case: Case | None = None
    steps: dict[Case, tuple[float, float, float]] = field(default_factory=dict)  # last (start, end, blocked)

    @property
    def blocked(self) -> bool:
        """Waiting in a call (or done): a rank that cannot move by itself."""
        return self.finished or self.waits is not None

    @property
    def in_loop(self) -> bool:
        """Waiting in one of the learner's calls, not between two steps."""
        return self.waits is not None and not self.waits.startswith(BETWEEN_STEPS)


class Verdict(Exception):
    """The check's answer when something is wrong: ``str`` is the paragraph to print."""


def check(lab: int, learner: Path) -> str:
    """The paragraph that says the learner's loop is right, or raises `Verdict` with what is wrong."""
    exercise = EXERCISES.get(lab)
    if exercise is None:
        raise Verdict(f"lab {lab} has no loop to check; the labs that do: {', '.join(map(str, EXERCISES))}")
    if not learner.is_file():
        raise Verdict(f"no file {learner}")
    try:
        load_function(learner, exercise.function)
    except Exception as error:  # a syntax error, a missing function: before any process starts
        raise Verdict(f"{learner} cannot be loaded: {type(error).__name__}: {error}") from None
    lines = []
    for world in RANK_COUNTS:
        lines += launch(exercise, learner, world)
    counts = "; ".join(f"p = {w}: m = {', '.join(str(c.m) for c in exercise.cases(w))}" for w in RANK_COUNTS)
    head = (
        f"all good: {exercise.function} gives the one-process model's messages, loss and gradients ({counts})"
    )
    return "\n".join([head, *lines])


def launch(exercise: Exercise, learner: Path, world: int) -> list[str]:
    """Run every case on ``world`` processes; the bubble lines, or `Verdict`."""
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    events = context.Queue()
    cases = exercise.cases(world)
    port = free_port()
    processes = [
        context.Process(
            target=run_rank,
            args=(rank, world, port, exercise.chunks, str(learner), exercise.function, cases, events),
            daemon=True,
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        states = watch(processes, events, world)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=10)
        events.close()
    return [bubble_line(exercise, world, case, states) for case in cases if case.timed]


def watch(processes, events, world: int) -> list[RankState]:
    """Follow the ranks until all finish; `Verdict` at the first fault, a deadlock or a lost process."""
    states = [RankState() for _ in range(world)]
    faults: list[Fault] = []
    started_at, moved_at, fault_at = time.monotonic(), None, None
    while not all(state.finished for state in states):
        try:
            event = events.get(timeout=0.1)
        except queue.Empty:
            event = None
        now = time.monotonic()
        if event is not None:
            kind, rank, case, *rest = event
            if kind == "fault":
                faults.append(rest[0])
                fault_at = fault_at or now
            else:
                follow(states[rank], kind, case, rest)
            if all(state.started for state in states):
                moved_at = now  # any report is news: a rank that starts to wait was busy until then
        if fault_at is not None and (now - fault_at > GRACE or all_stopped(states, processes)):
            first = min(faults, key=lambda f: (f.case.m, f.order))
            raise Verdict(f"wrong, with {world} ranks and m = {first.case.m}: {first.text}")
        if fault_at is None:
            lost = [r for r, p in enumerate(processes) if not p.is_alive() and not states[r].finished]
            if lost and event is None:
                code = processes[lost[0]].exitcode
                raise Verdict(
                    f"rank {lost[0]} ended without finishing (exit code {code}), with {world} ranks"
                )
            if moved_at is not None and now - moved_at > STALL and stuck(states):
                raise Verdict(deadlock(states, world, now - moved_at))
            if moved_at is not None and now - moved_at > SILENCE:  # a rank computes forever
                raise Verdict(deadlock(states, world, now - moved_at).replace("deadlock", "no progress", 1))
            if moved_at is None and now - started_at > START_LIMIT:
                raise Verdict(f"the {world} processes did not all start within {START_LIMIT:g}s")
    return states


def stuck(states: list[RankState]) -> bool:
    """Every rank waits, and one of them in the learner's loop: ranks that all wait between steps are
    only slow to get there (a busy machine), never stuck."""
    return all(state.blocked for state in states) and any(state.in_loop for state in states)


def follow(state: RankState, kind: str, case: Case | None, rest: list) -> None:
    if kind == "started":
        state.started = True
    elif kind == "finished":
        state.finished = True
    elif kind == "begin":
        state.case, state.did, state.waits = case, "started its step", None
    elif kind == "did":
        state.did, state.waits = rest[0], None
    elif kind == "waits":
        state.waits = rest[0]
    elif kind == "step done":
        state.did, state.waits = "finished its step", None
        state.steps[case] = tuple(rest)


def all_stopped(states: list[RankState], processes) -> bool:
    return all(not p.is_alive() or s.finished for s, p in zip(states, processes, strict=True))


def deadlock(states: list[RankState], world: int, still: float) -> str:
    m = next((s.case.m for s in states if s.case is not None), "?")
    lines = [f"deadlock, with {world} ranks and m = {m}: no rank has moved for {still:.0f}s"]
    for rank, state in enumerate(states):
        peer = re.search(r"(from|to) rank (\d+)$", state.waits or "")
        if peer and states[int(peer[2])].did == "finished its step":
            never = "sending it" if peer[1] == "from" else "taking it"
            lines.append(f"  rank {rank} waits {state.waits}, which finished its step without {never}")
    lines.append("what each rank did last, and what it waits for:")
    for rank, state in enumerate(states):
        lines.append(f"  rank {rank}: last did: {state.did}; {_now_doing(state)}")
    return "\n".join(lines)


def _now_doing(state: RankState) -> str:
    if state.finished:
        return "it is done"
    return f"waits {state.waits}" if state.waits else "computes, in no message (an endless loop?)"


def bubble_line(exercise: Exercise, world: int, case: Case, states: list[RankState]) -> str:
    """The bubble of the timed step, from the ranks' records: 1 - busy time / (ranks x step)."""
    steps = [state.steps[case] for state in states]
    span = max(end for _, end, _ in steps) - min(start for start, _, _ in steps)
    busy = sum(end - start - blocked for start, end, blocked in steps)
    formula = bubble_formula(exercise.schedule, world, case.m, exercise.chunks)
    return (
        f"  p = {world}, m = {case.m}: measured bubble {1 - busy / (world * span):.1%} "
        f"vs formula {bubble_formula_text(exercise.schedule)} = {formula:.1%}"
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
