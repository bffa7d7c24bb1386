"""The timeline: what each rank did and when, whether predicted by the simulator or measured in a run.

A `Timeline` is a bag of `Span`s, one per executed action. Every figure the project reports (bubble,
utilisation, peak activations) is computed here from that record, so a simulated and a measured step
are judged by the same code.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeclock.engine.spans import Span


class Timeline:
    """The spans of one training step on ``num_ranks`` ranks, each holding ``chunks`` model chunks."""

    def __init__(self, spans: Iterable[Span], num_ranks: int, chunks: int = 1) -> None:
        self.spans: list[Span] = sorted(spans, key=lambda s: (s.start, s.rank, s.end))
        self.num_ranks = num_ranks
        self.chunks = chunks
        bad = [s for s in self.spans if not 0 <= s.rank < num_ranks or s.end < s.start]
        if bad:
            raise ValueError(f"span {bad[0]} does not fit a timeline of {num_ranks} ranks")
        self.start = min((s.start for s in self.spans), default=0.0)
        self.makespan = max((s.end for s in self.spans), default=0.0) - self.start  # first start to last end
        self._by_rank: dict[int, list[Span]] = {}
        for span in self.spans:
            self._by_rank.setdefault(span.rank, []).append(span)

    def __repr__(self) -> str:
        return f"Timeline({len(self.spans)} spans, {self.num_ranks} ranks, makespan {self.makespan:g})"

    def spans_of(self, rank: int) -> list[Span]:
        """Rank ``rank``'s spans in the order they started."""
        return list(self._by_rank.get(rank, ()))

    @property
    def num_microbatches(self) -> int:
        return len({s.action.microbatch for s in self.spans})

    def busy(self, rank: int) -> float:
        """Time rank ``rank`` spent computing (communication waits excluded)."""
        return sum(s.compute for s in self.spans_of(rank))

    def busy_fraction(self, rank: int) -> float:
        return self.busy(rank) / self.makespan if self.makespan else 0.0

    @property
    def bubble_share(self) -> float:
        """The share of all ranks' time spent idle: 1 - total busy / (ranks x makespan)."""
        if not self.makespan:
            return 0.0
        total_busy = sum(self.busy(rank) for rank in range(self.num_ranks))
        return 1.0 - total_busy / (self.num_ranks * self.makespan)

    @property
    def bubble_vs_ideal(self) -> float:
        """How much longer the step is than the busiest rank's compute alone: (makespan - ideal) / ideal.

        This is the bubble as the papers usually quote it: the time a perfect pipeline would not spend.
        """
        ideal = max((self.busy(rank) for rank in range(self.num_ranks)), default=0.0)
        return (self.makespan - ideal) / ideal if ideal else 0.0

    def peak_live(self, rank: int) -> float:
        """The most activations rank ``rank`` holds at once, in stages (each chunk counts 1/chunks)."""
        return max(self.held_over_time(rank)[1])

    def held_over_time(self, rank: int) -> tuple[list[float], list[float]]:
        """When rank ``rank``'s count of held activations changes, and the count (in stages) from then.

        A (micro-batch, chunk) pair is held from the moment its F starts computing (not while the F
        waits for its input: nothing is stored then) to the end of its last backward op (its B, or its W
        when the backward is split). A pair released at the instant another starts is not counted twice:
        memory is freed before it is taken again.
        """
        born: dict[tuple[int, int], float] = {}
        freed: dict[tuple[int, int], float] = {}
        for s in self.spans_of(rank):
            key = (s.action.microbatch, s.action.chunk)
            if s.action.op == "F":
                born[key] = s.start + s.wait
            else:
                freed[key] = max(freed.get(key, s.end), s.end)
        events = sorted([(t, 1) for t in born.values()] + [(freed.get(k, float("inf")), -1) for k in born])
        times, held, live = [self.start], [0.0], 0
        for time, change in events:
            live += change
            times.append(time)
            held.append(live / self.chunks)
        return times, held

    def to_chrome_trace(self, time_unit_us: float = 1.0) -> dict:
        """The timeline as Chrome trace / Perfetto JSON: one complete ("X") event per span, pid = rank.

        ``time_unit_us`` is how many microseconds one unit of this timeline's time is (1e6 for seconds).
        """
        names = [
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
            for rank in range(self.num_ranks)
        ]
        return {
            "traceEvents": names + [self._trace_event(s, time_unit_us) for s in self.spans],
            "displayTimeUnit": "ms",
        }

    @staticmethod
    def _trace_event(span: Span, time_unit_us: float) -> dict:
        return {
            "name": str(span.action),
            "cat": span.action.op,
            "ph": "X",
            "pid": span.rank,
            "tid": 0,
            "ts": span.start * time_unit_us,
            "dur": span.duration * time_unit_us,
            "args": {
                "microbatch": span.action.microbatch,
                "chunk": span.action.chunk,
                "wait_us": span.wait * time_unit_us,
            },
        }
