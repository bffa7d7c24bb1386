"""What a pipeline needs to know about the copies of itself that run side by side (data parallelism).

With data parallelism, dp replicas of the same pipeline each take a shard of the global batch, and
their gradients are summed before the optimizer step. The engine does not average anything itself: an
existing engine (FSDP2 or DDP, wrapped in ``pipeclock.parallel``) does. The orchestrator only has to tell
it *when*: a chunk's gradients are complete after that chunk's last backward (or ``W``) of the step, and
only then may they be summed across replicas. This module is the small interface between the two:
``Replicas`` says what the orchestrator calls, ``SinglePipeline`` is the one-replica case (no calls).

The loss of a replica is weighted by its share of what the *global* batch averages over (samples, or
counted tokens), so summing the replicas' gradients gives the one-device gradient exactly, whatever the
shards' sizes or padding.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Replicas(Protocol):
    """The data-parallel side of a pipeline: one instance per rank, over that rank's dp group."""

    group: dist.ProcessGroup | None  # the ranks holding the same stage in the other replicas
    size: int  # the number of replicas
    split_backward: bool  # False: B runs whole and W does nothing (the engine's hooks need autograd)
    shards_gradients: bool  # True: each replica holds a shard of every gradient (FSDP2), not all of it

    def begin_step(self) -> None:
        """Before the first backward of a step: gradients accumulate locally, unsynced."""

    def before_last_backward(self, chunk: int, roots: list[torch.Tensor]) -> None:
        """Just before chunk ``chunk``'s last backward of the step starts from ``roots``."""

    def after_last_backward(self, chunk: int) -> None:
        """Chunk ``chunk``'s gradients are complete on this replica: sum them across replicas."""

    def end_evaluation(self) -> None:
        """After a forward-only pass: no backward will release what the forwards gathered."""

    def take_sync_times(self) -> list[tuple[float, float]]:
        """(start, end) of the sums the engine ran by itself during the step's backwards (DDP's buckets)."""

    def total(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """``value`` summed over the replicas (in place)."""

    def first_sample(self, batch_size: int) -> int:
        """Where this replica's shard starts in the global batch (shards are contiguous, in dp order).

        Dropout masks are keyed by a sample's place in the global batch, so they do not depend on dp.
        Raises ``ValueError`` when another replica refused its batch (``refuse_batch``).
        """

    def refuse_batch(self) -> None:
        """This replica's batch was refused: tell the others, who are waiting in ``first_sample``."""


class SinglePipeline:
    """One replica: nothing to synchronise."""

    group = None
    size = 1
    split_backward = True
    shards_gradients = False

    def begin_step(self) -> None:
        pass

    def before_last_backward(self, chunk: int, roots: list[torch.Tensor]) -> None:
        pass

    def after_last_backward(self, chunk: int) -> None:
        pass

    def end_evaluation(self) -> None:
        pass

    def take_sync_times(self) -> list[tuple[float, float]]:
        return []

    def total(self, value: torch.Tensor, what: str) -> torch.Tensor:
        return value

    def first_sample(self, batch_size: int) -> int:
        return 0

    def refuse_batch(self) -> None:
        pass
