"""``pipeclock lab N --check FILE``: run a learner's schedule loop on real processes and say what is wrong.

The file is first imported where it is watched (`learner_file.probe`): whatever it does at module level
is one line. Then, for 2 and then 4 ranks, one launch of gloo processes runs the learner's function for
several micro-batch counts (fewer micro-batches than ranks among them) against the one-process model
(`check_rank`), following it as it goes (`watch`). The answer is one paragraph in plain words: all good,
with the loop's order drawn and the micro-batches it held at most; or the first thing wrong: a message
or a gradient that differs (which rank, which micro-batch, forward or backward, by how much, or whose
it is), a wrong loss, an exception (its line in the learner's file), an order that leaves the lab's
schedule (where, in the schedule's terms), or a deadlock (each rank's wait beside what the schedule
runs there). The processes are always killed before the answer.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeclock.course.check_rank import run_rank
from pipeclock.course.learner_file import LoadError, probe
from pipeclock.course.order import Lab, drawn
from pipeclock.course.reference import Case
from pipeclock.course.watch import Verdict, Watch, watch

__all__ = ["EXERCISES", "Verdict", "check"]


@dataclass(frozen=True)
class Exercise:
    """A lab's loop: the function a learner writes, and the schedule it implements."""

    lab: int
    function: str
    schedule: str
    chunks: int = 1

    def cases(self, world: int) -> list[Case]:
        """m < p, then uneven splits of the batch of 11, then m = 2p: the step the answer draws."""
        return [Case(m) for m in {2: [1, 3, 4], 4: [2, 5, 8]}[world]]

    def lab_of(self, world: int) -> Callable[[int], Lab]:
        """The lab's schedule with ``world`` ranks, for each micro-batch count."""
        return lambda m: Lab(self.schedule, world, m, self.chunks)


EXERCISES = {
    4: Exercise(4, "naive_step", "naive"),
    5: Exercise(5, "gpipe_step", "gpipe"),
    6: Exercise(6, "one_f_one_b_step", "1f1b"),
    7: Exercise(7, "interleaved_step", "interleaved-1f1b", chunks=2),
}
RANK_COUNTS = (2, 4)
WIDTH = 120  # the widest drawing the answer shows


def check(lab: int, learner: Path) -> str:
    """The paragraph that says the learner's loop is right, or raises `Verdict` with what is wrong."""
    exercise = EXERCISES.get(lab)
    if exercise is None:
        raise Verdict(f"lab {lab} has no loop to check; the labs that do: {', '.join(map(str, EXERCISES))}")
    if not learner.is_file():
        raise Verdict(f"no file {learner}")
    try:
        probe(learner, exercise.function)
    except LoadError as error:
        raise Verdict(str(error)) from None
    watched = [launch(exercise, learner, world) for world in RANK_COUNTS]
    return answer(exercise, watched)


def answer(exercise: Exercise, watched: list[Watch]) -> str:
    """All good: the cases run, the largest step whose drawing fits a terminal, and what each rank held
    at most in it (measured: the micro-batches whose saved tensors were alive at once)."""
    counts = "; ".join(f"p = {w}: m = {', '.join(str(c.m) for c in exercise.cases(w))}" for w in RANK_COUNTS)
    steps = [(seen, case.m) for seen in watched for case in exercise.cases(seen.world)]
    for seen, m in reversed(steps):
        rows = [seen.ran(m)[rank] for rank in range(seen.world)]
        picture = drawn(rows) or ""
        if max(map(len, picture.splitlines()), default=0) <= WIDTH:
            break
    lab = exercise.lab_of(seen.world)(m)
    unit = "micro-batch chunks" if exercise.chunks > 1 else "micro-batches"
    peaks = " ".join(map(str, seen.kept(m)))
    rule = {"naive": "1", "gpipe": "m", "1f1b": "min(m, p − r)"}.get(exercise.schedule)
    return "\n".join(
        [
            f"all good: {exercise.function} runs {lab.name}'s order and gives the one-process model's "
            f"messages, loss and gradients ({counts})",
            f"your loop with p = {seen.world} and m = {m}, in the order it ran, drawn as "
            "`pipeclock schedule` draws one (F = 1, B = 2; dots are idle):",
            picture,
            f"{unit} held at most: {peaks} (rank 0 first)" + (f", {lab.name}'s {rule}" if rule else ""),
        ]
    )


def launch(exercise: Exercise, learner: Path, world: int) -> Watch:
    """Run every case on ``world`` processes; what the watcher saw, or `Verdict`."""
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    events = context.Queue()
    cases = exercise.cases(world)
    # The ranks meet in a file, not at a port: a port found free and let go can be taken before rank 0
    # binds it (by another check, a test's store), and its rank 0 then fails for no fault of the loop.
    folder = tempfile.mkdtemp(prefix="pipeclock-check-")
    store = str(Path(folder) / "store")
    processes = [
        context.Process(
            target=run_rank,
            args=(rank, world, store, exercise.chunks, str(learner), exercise.function, cases, events),
            daemon=True,
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        return watch(processes, events, world, exercise.lab_of(world))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=10)
        events.close()
        shutil.rmtree(folder, ignore_errors=True)
