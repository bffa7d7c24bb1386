"""A span: one action of one rank, from its start to its end; what a run records and a simulator predicts.

The engine records a ``Span`` per action it runs (``StepRecord.spans``); ``pipeclock.observe.timeline``
reads figures (bubble, busy share, peak activations) from a bag of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeclock.engine.actions import Action


@dataclass(frozen=True, slots=True)
class Span:
    """Rank ``rank`` ran ``action`` from ``start`` to ``end``.

    Times are in any unit (simulator units, seconds) as long as a timeline uses one. ``wait`` is the part
    of the span spent blocked on communication rather than computing (always 0 in the simulator).
    """

    rank: int
    action: Action
    start: float
    end: float
    wait: float = 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def compute(self) -> float:
        """Time actually spent computing: the span minus its communication wait."""
        return self.duration - self.wait
