"""Which rank runs which virtual stage: part of a schedule, like the order of its actions.

A model cut into ``S`` virtual stages runs on ``p`` ranks, each holding one or more of them as its local
chunks (always in increasing stage order: chunk 0 is the rank's lowest stage). Two placements have names:

- ``loop``: rank r holds stages r, r + p, r + 2p, ... An activation goes round the ranks once per chunk
  (Megatron's interleaving; with one chunk, the plain pipeline).
- ``v``: rank r holds stages r and 2p - 1 - r. The activation goes down the ranks and comes back up:
  the first and the last stage share rank 0, so the loss is computed where the inputs are read, and
  the hand-off from stage p - 1 to stage p stays on rank p - 1 (ZB-V, DualPipeV).

Any other assignment (read from a CSV schedule) is a ``Placement`` too; nothing else in pipeclock assumes
one or the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Placement:
    """``stages[r]`` lists rank r's virtual stages, in increasing order (its chunks 0, 1, ...)."""

    stages: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        every = sorted(s for rank in self.stages for s in rank)
        if not self.stages or every != list(range(len(every))):
            raise ValueError(
                f"a placement must give every stage 0..S-1 to exactly one rank, got {self.stages}"
            )
        if any(not rank or list(rank) != sorted(rank) for rank in self.stages):
            raise ValueError(f"every rank needs stages, listed in increasing order, got {self.stages}")

    @classmethod
    def loop(cls, num_ranks: int, chunks: int = 1) -> Placement:
        return cls(tuple(tuple(c * num_ranks + r for c in range(chunks)) for r in range(num_ranks)))

    @classmethod
    def v(cls, num_ranks: int) -> Placement:
        return cls(tuple((r, 2 * num_ranks - 1 - r) for r in range(num_ranks)))

    @classmethod
    def named(cls, name: str, num_ranks: int, chunks: int = 1) -> Placement:
        if name == "loop":
            return cls.loop(num_ranks, chunks)
        if name == "v":
            return cls.v(num_ranks)
        raise ValueError(f"unknown placement {name!r}: use loop or v")

    @property
    def num_ranks(self) -> int:
        return len(self.stages)

    @cached_property
    def num_virtual(self) -> int:
        return sum(len(rank) for rank in self.stages)

    @property
    def chunks(self) -> int:
        """The most chunks any rank holds."""
        return max(len(rank) for rank in self.stages)

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage that is rank ``rank``'s local ``chunk``."""
        return self.stages[rank][chunk]

    def owner(self, stage: int) -> tuple[int, int]:
        """The (rank, local chunk) that runs virtual stage ``stage``."""
        return self._owners[stage]

    @cached_property
    def _owners(self) -> dict[int, tuple[int, int]]:
        return {s: (r, c) for r, rank in enumerate(self.stages) for c, s in enumerate(rank)}

    @property
    def name(self) -> str:
        """``loop``, ``v``, or ``custom``."""
        if self == Placement.loop(self.num_ranks, self.chunks):
            return "loop"
        if self.chunks == 2 and self == Placement.v(self.num_ranks):
            return "v"
        return "custom"
