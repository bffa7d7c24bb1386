"""A learner's loop held to its lab's schedule: the order of its forwards and backwards, and what it holds.

The checker records, on every rank, the forwards and backwards the learner's loop computed (as engine
`Action`s: ``F2``, ``B0``, ``F3.1``) and compares them with the lab's schedule as the engine's own
generator makes it. The first place they part is said in the schedule's terms: what came before, what
the schedule runs there and why (its phase and the rule that sets it), and what the loop ran instead.
When messages are posted is not compared: a non-blocking send may go out whenever the loop likes.
A micro-batch is *held* from its forward to its backward; the most a rank holds at once is what its
activations cost, and the schedule sets a bound on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeclock.engine.actions import Action
from pipeclock.engine.generators import generate
from pipeclock.observe.diagrams import ascii_diagram
from pipeclock.observe.simulate import DeadlockError, simulate

NAMES = {"naive": "naive", "gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}
HELD_RULE = {"naive": "1", "gpipe": "m", "1f1b": "min(m, p − r)"}

Rows = list[list[Action]]


@dataclass(frozen=True)
class Lab:
    """A lab's schedule and its shape: ``p`` ranks, ``m`` micro-batches, ``chunks`` per rank."""

    schedule: str
    p: int
    m: int
    chunks: int = 1

    @property
    def name(self) -> str:
        return NAMES.get(self.schedule, self.schedule)

    @property
    def title(self) -> str:
        chunks = f", v = {self.chunks}" if self.chunks > 1 else ""
        return f"{self.name}, p = {self.p}{chunks}, m = {self.m}"

    def rows(self) -> Rows:
        return [list(row) for row in generate(self.schedule, self.p, self.m, self.chunks)]

    def why(self, rank: int, position: int) -> str:
        """The rule that puts the schedule's action at ``position`` of ``rank``'s list."""
        p, m, r = self.p, self.m, rank
        if self.schedule == "naive":
            return "stop and wait: each micro-batch's backward before the next forward"
        if self.schedule == "gpipe":
            return (
                "fill: all m forwards first"
                if position < m
                else "drain: the backwards in the forwards' order"
            )
        if self.schedule == "1f1b":
            warmup = min(p - r - 1, m)
            rule = (
                f"warm-up p − r − 1 = {warmup}"
                if warmup == p - r - 1
                else f"warm-up min(p − r − 1, m) = {warmup}"
            )
            if position >= warmup + 2 * (m - warmup):
                return f"cool-down: after the last forward, the {warmup} backwards left"
            return rule
        warmup = min(2 * (p - r - 1) + (self.chunks - 1) * p, -(-m // p) * p * self.chunks)
        return (
            f"warm-up 2(p − r − 1) + (v − 1)p = {warmup} forwards counted on m rounded up to a multiple "
            "of p, then one forward and one backward in turn; micro-batches in rounds of p, chunks in order "
            "forward and reversed backward"
        )

    def held_rule(self, rank: int, most: int) -> str:
        rule = HELD_RULE.get(self.schedule)
        return f"{most} ({rule})" if rule and rule != str(most) else str(most)


def divergence(
    lab: Lab, ran: dict[int, list[Action]], complete: bool, ended: frozenset[int] = frozenset()
) -> tuple[tuple[int, int], str] | None:
    """The first place a rank's loop left the schedule, as ((position, rank), the line that says it), or
    None. With ``complete`` false the lists may still grow (but those of the ranks in ``ended``, whose
    step is over): only a wrong action counts, not a missing one. Among ranks the earliest position
    wins, then the lowest rank, so the answer never depends on which rank reported first."""
    found = []
    for rank, want in enumerate(lab.rows()):
        got = ran.get(rank, [])
        k = next(
            (k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        if k == len(got) == len(want) or (k == len(got) and not complete and rank not in ended):
            continue
        before = f"after {got[k - 1]}" if k else "at its first action"
        head = f"{lab.title}, rank {rank}: {before}"
        if k == len(want):
            text = f"{head} the schedule's step is over; your loop ran {got[k]}"
        else:
            yours = f"your loop ran {got[k]}" if k < len(got) else "your loop's step ended there"
            yours = yours if got else "your loop computed nothing: no forward, no backward"
            text = f"{head} the schedule runs {want[k]} ({lab.why(rank, k)}); {yours}"
        found.append(((k, rank), text))
    return min(found, default=None)


def held(row: list[Action]) -> int:
    """The most micro-batches (per chunk) ``row`` holds at once: taken by an F, let go by its backward."""
    now = most = 0
    for action in row:
        now += 1 if action.op == "F" else -1 if action.op in ("B", "I") else 0
        most = max(most, now)
    return most


def held_beyond(lab: Lab, ran: dict[int, list[Action]]) -> str | None:
    """The first rank that held more micro-batches at once than the schedule does there, said in a line."""
    for rank, want in enumerate(lab.rows()):
        got, bound = held(ran.get(rank, [])), held(want)
        if got > bound:
            unit = "micro-batch chunks" if lab.chunks > 1 else "micro-batches"
            most = lab.held_rule(rank, bound)
            return f"rank {rank} held {got} {unit} at once, where {lab.name} holds at most {most}"
    return None


KEPT_HINT = (
    "a graph lives until its backward frees it: retain_graph=True, or an output kept after its backward, "
    "keeps every micro-batch's activations alive"
)


def kept_beyond(lab: Lab, kept: list[int]) -> tuple[int, str] | None:
    """The first rank whose loop, in the schedule's order, kept more micro-batches' saved tensors alive
    at once than the schedule holds there (``kept``: measured per rank), as (rank, the verdict)."""
    for rank, want in enumerate(lab.rows()):
        bound = held(want)
        if kept[rank] > bound:
            unit = "micro-batch chunks" if lab.chunks > 1 else "micro-batches"
            return rank, (
                f"wrong memory: {lab.title}, rank {rank} kept the saved tensors of {kept[rank]} {unit} alive "
                f"at once (measured), where {lab.name} holds at most {lab.held_rule(rank, bound)}: the order "
                f"is right, the memory is not; {KEPT_HINT}"
            )
    return None


def drawn(rows: Rows, chunks: int = 1) -> str | None:
    """``rows`` as `pipeclock schedule` draws a schedule (F costs 1, B 2), or None when they are not a
    whole step that can run (a micro-batch missing, or an order that waits forever)."""
    try:
        return ascii_diagram(simulate([list(row) for row in rows]))
    except (ValueError, DeadlockError):
        return None


def listed(rows: Rows) -> str:
    """``rows`` written out, one rank a line, when they cannot be drawn."""
    return "\n".join(f"rank {rank} | {' '.join(map(str, row))}" for rank, row in enumerate(rows))


def next_in_schedule(lab: Lab, rank: int, done: list[Action]) -> str:
    """What the schedule runs on ``rank`` after the actions ``done`` (when they follow it so far)."""
    want = lab.rows()[rank]
    if done != want[: len(done)]:
        return ""
    if len(done) >= len(want):
        return f"{lab.name}: rank {rank}'s step is over"
    return f"{lab.name}'s next: {want[len(done)]}"
