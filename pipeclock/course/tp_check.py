"""``pipeclock lab 12 --check FILE``: a learner's column- and row-parallel Linears, run on real processes.

For 2 and then 4 ranks, one launch of gloo processes (`tp_check_rank`) builds the learner's two
classes from one process's layers and holds each rank's weights, outputs, input gradient and weight
gradients to that process's, alone and then as an MLP. The answer is one line: all good, or the first
thing wrong, naming the rank and the phase's fault (the earliest phase, then the lowest rank, among
the faults the ranks report); an exception is its line in the learner's file. A rank stuck for
``STALL`` seconds (a collective that not every rank calls) is named with the phase it is stuck in. The
processes are always killed before the answer.
"""

from __future__ import annotations

import multiprocessing
import queue
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeclock.course.tp_check_rank import CLASSES, PHASES, load_classes, run_rank
from pipeclock.course.tp_reference import BATCH, HIDDEN, WIDTH

LAB = 12
RANK_COUNTS = (2, 4)
STALL = 10.0  # seconds without any report, every rank started: a rank is stuck
START_LIMIT = 120.0  # seconds for the processes to start and join the group
GRACE = 2.0  # seconds without news after a fault, before naming it: the other ranks' faults may come


class Verdict(Exception):
    """The check's answer when something is wrong: ``str`` is the line to print."""


@dataclass
class RankState:
    started: bool = False
    finished: bool = False
    phase: int = -1
    waiting: bool = False  # at the barrier after ``phase``
    fault: tuple[int, str] | None = None

    def settled(self, phase: int) -> bool:
        """Whether it has said all it will about ``phase``: done, failed, or waiting after that phase
        or a later one (a rank waiting after an earlier phase still has ``phase`` to run)."""
        return self.finished or self.fault is not None or (self.waiting and self.phase >= phase)


@dataclass
class Watch:
    world: int
    stall: float
    states: list[RankState] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.states = [RankState() for _ in range(self.world)]

    def follow(self, kind: str, rank: int, *rest) -> None:
        state = self.states[rank]
        if kind == "started":
            state.started = True
        elif kind == "finished":
            state.finished = True
        elif kind == "phase":
            state.phase, state.waiting = rest[0], False
        elif kind == "waits":
            state.waiting = True
        elif kind == "fault":
            state.fault = (rest[0], rest[1])

    def all_said(self) -> bool:
        """Every rank has said what it will about the earliest phase a fault was found in."""
        phase = min(s.fault[0] for s in self.states if s.fault)
        return all(s.settled(phase) for s in self.states)

    def first_fault(self) -> str | None:
        faults = [(s.fault[0], rank, s.fault[1]) for rank, s in enumerate(self.states) if s.fault]
        return min(faults)[2] if faults else None

    def stuck(self) -> str:
        where = []
        for rank, state in enumerate(self.states):
            if state.finished:
                where.append(f"rank {rank} finished")
            elif state.waiting:
                where.append(f"rank {rank} waits for the others after {PHASES[state.phase]}")
            else:
                where.append(f"rank {rank} is still in {PHASES[state.phase]}")
        return (
            f"stuck, with {self.world} ranks: no rank moved for {self.stall:g}s ({'; '.join(where)}): a "
            "collective or a message that not every rank takes part in?"
        )


def check(learner: Path, stall: float = STALL) -> str:
    """The line that says the learner's classes are right, or raises `Verdict` with what is wrong."""
    if not learner.is_file():
        raise Verdict(f"no file {learner}")
    try:
        load_classes(learner.resolve())
    except BaseException as error:  # a syntax error, a missing class, an exit: before any process starts
        if isinstance(error, KeyboardInterrupt):
            raise
        text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
        raise Verdict(f"{learner} cannot be loaded: {text}") from None
    for world in RANK_COUNTS:
        launch(learner, world, stall)
    counts = " and ".join(map(str, RANK_COUNTS))
    return (
        f"all good: {' and '.join(CLASSES)} give one process's outputs, input gradients and weight "
        f"gradients, alone and as an MLP {HIDDEN} -> {WIDTH} -> {HIDDEN} (a batch of {BATCH}), on {counts} "
        "ranks"
    )


def launch(learner: Path, world: int, stall: float) -> None:
    """Run every phase on ``world`` processes; returns when all passed, or raises `Verdict`."""
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    events = context.Queue()
    folder = tempfile.mkdtemp(prefix="pipeclock-lab12-")
    store = str(Path(folder) / "store")
    processes = [
        context.Process(target=run_rank, args=(rank, world, store, str(learner), events), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        watch(Watch(world, stall), processes, events)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=10)
        events.close()
        shutil.rmtree(folder, ignore_errors=True)


def watch(state: Watch, processes, events) -> None:
    """Follow the ranks until all finish; `Verdict` at the first fault, a stuck rank or a lost process."""
    started_at, moved_at, fault_at = time.monotonic(), time.monotonic(), None
    world = state.world
    while not all(s.finished for s in state.states):
        try:
            event = events.get(timeout=0.1)
        except queue.Empty:
            event = None
        now = time.monotonic()
        if event is not None:
            state.follow(*event)
            moved_at = now
            if event[0] == "fault" or fault_at is not None:
                fault_at = now
        if fault_at is not None and (now - fault_at > GRACE or state.all_said()):
            raise Verdict(f"wrong, with {world} ranks: {state.first_fault()}")
        if event is None:
            lost = [r for r, p in enumerate(processes) if not p.is_alive() and not state.states[r].settled(0)]
            if lost:
                code = processes[lost[0]].exitcode
                raise Verdict(
                    f"rank {lost[0]} ended without finishing (exit code {code}), with {world} ranks"
                )
        if not all(s.started for s in state.states):
            if now - started_at > START_LIMIT:
                raise Verdict(f"the {world} processes did not all start within {START_LIMIT:g}s")
        elif now - moved_at > state.stall:
            raise Verdict(state.stuck())


def answer(learner: Path) -> int:
    """``lab 12 --check FILE``: the answer printed; 0 when the classes are right, 1 when not, 2 when there
    is no such file."""
    if not learner.is_file():
        print(f"pipeclock lab: error: --check {learner}: no such file", file=sys.stderr)
        return 2
    counts = " and ".join(map(str, RANK_COUNTS))
    print(f"checking {learner} for lab {LAB}, on {counts} processes...", flush=True)
    try:
        print(check(learner))
        return 0
    except Verdict as verdict:
        print(verdict)
        return 1
