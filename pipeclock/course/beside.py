"""A lab's hand-written loop beside the engine: one step each on the same model and batch, compared.

Labs 4 to 7 teach a schedule by its loop (``labs/solutions/``, a function written with ``comms`` and
autograd only) and run it here next to ``schedule.Pipeline`` with the same schedule: same loss, same
gradients (to float rounding), and each one's bubble and time spent blocked on messages, measured the
same way: a rank's step minus the time it waited. The engine posts its receives ahead of the actions
that need them; the loop asks for each message when it needs it and waits there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeclock import comms
from pipeclock.course.recorder import Pipe, Recorder
from pipeclock.engine.generators import bubble_formula, bubble_formula_text
from pipeclock.engine.orchestrator import Pipeline
from pipeclock.model import ShardedMLP
from pipeclock.models.regression import SyntheticRegression


@dataclass(frozen=True)
class StepTaken:
    """One rank's measured step: when it started and ended, how long it computed and how long it waited
    for messages, its loss (or None) and its parameters' gradients."""

    start: float
    end: float
    busy: float
    waited: float
    loss: float | None
    grads: list[torch.Tensor]

    def summary(self) -> tuple[float, float, float, float, float | None]:
        return self.start, self.end, self.busy, self.waited, self.loss


@dataclass(frozen=True)
class Side:
    """One way of running the step, over all ranks (on rank 0)."""

    loss: float
    bubble: float
    waited: list[float]  # seconds per rank

    @classmethod
    def of(cls, steps: list[tuple[float, float, float, float, float | None]]) -> Side:
        """1 - busy / (ranks x step): the step from the first rank's start to the last rank's end."""
        span = max(end for _, end, *_ in steps) - min(start for start, *_ in steps)
        bubble = 1 - sum(busy for _, _, busy, _, _ in steps) / (len(steps) * span)
        loss = next(loss for *_, loss in steps if loss is not None)
        return cls(loss, bubble, [waited for _, _, _, waited, _ in steps])


def compare(
    loop: Callable,
    schedule: str,
    hidden: int,
    layers: int,
    batch_size: int,
    m: int,
    chunks: int = 1,
    seed: int = 0,
) -> list[str] | None:
    """Run ``loop`` and the engine's ``schedule`` one step each (after one unmeasured step); on rank 0 the
    lines that compare them, None on the other ranks."""
    batch = SyntheticRegression(hidden, seed=seed).batch(0, batch_size)
    parts = _stage(hidden, layers, chunks, seed)
    loop_step = _twice(parts, lambda: _loop_step(loop, parts, batch, m))
    engine = Pipeline(_stage(hidden, layers, chunks, seed), schedule, m, F.mse_loss, measure_memory=False)
    engine_step = _twice(engine.chunks, lambda: _engine_step(engine, batch))
    gap = max((a - b).abs().max().item() for a, b in zip(loop_step.grads, engine_step.grads, strict=True))
    largest = max(g.abs().max().item() for g in engine_step.grads)
    mine = (loop_step.summary(), engine_step.summary(), gap, largest)
    gathered = comms.gather_object(mine, "gathering the loop's and the engine's steps")
    if gathered is None:
        return None
    loop_side, engine_side = (Side.of([g[k] for g in gathered]) for k in (0, 1))
    p = len(gathered)
    formula = f"{bubble_formula_text(schedule)} = {bubble_formula(schedule, p, m, chunks):.1%}"
    waited = ", ".join(
        f"rank {r} {a * 1e3:.1f} / {b * 1e3:.1f} ms"
        for r, (a, b) in enumerate(zip(loop_side.waited, engine_side.waited, strict=True))
    )
    source = f"labs/solutions/{loop.__module__.rsplit('.', 1)[-1]}.py"
    return [
        f"the loop of {source} beside the engine, one step each on the same model and batch:",
        f"  loss             {loop_side.loss:.6f} (loop) vs {engine_side.loss:.6f} (engine)",
        f"  gradients        differ by at most {max(g[2] for g in gathered):.1e} "
        f"(largest {max(g[3] for g in gathered):.1e}), on every rank",
        f"  measured bubble  loop {loop_side.bubble:.1%} vs engine {engine_side.bubble:.1%}; "
        f"formula {formula}",
        f"  waiting for messages, loop / engine: {waited}",
    ]


def _twice(parts, step: Callable[[], StepTaken]) -> StepTaken:
    """The second of two steps: the first pays for connections and allocations."""
    step()
    for part in parts:
        part.zero_grad()
    return step()


def _stage(hidden: int, layers: int, chunks: int, seed: int) -> list[ShardedMLP]:
    return ShardedMLP.for_rank(
        hidden, layers, comms.get_rank(), comms.get_world_size(), chunks=chunks, seed=seed
    )


def _loop_step(loop: Callable, parts: list[ShardedMLP], batch, m: int) -> StepTaken:
    rank, world = comms.get_rank(), comms.get_world_size()
    inputs, targets = batch
    with Recorder(rank, Pipe(world, len(parts), m)) as recorder:
        comms.barrier("starting the loop's step")
        start = time.perf_counter()
        stage = parts if len(parts) > 1 else parts[0]
        loss = loop(
            stage, inputs if rank == 0 else None, targets if rank == world - 1 else None, m, F.mse_loss
        )
        end = time.perf_counter()
    grads = [p.grad for part in parts for p in part.parameters()]
    return StepTaken(start, end, end - start - recorder.blocked, recorder.blocked, loss, grads)


def _engine_step(engine: Pipeline, batch) -> StepTaken:
    rank, world = comms.get_rank(), comms.get_world_size()
    inputs, targets = batch
    comms.barrier("starting the engine's step")
    start = time.perf_counter()
    loss = engine.step(inputs if rank == 0 else None, targets if rank == world - 1 else None)
    end = time.perf_counter()
    spans = engine.last.spans
    grads = [p.grad for part in engine.chunks for p in part.parameters()]
    busy, waited = sum(s.compute for s in spans), sum(s.wait for s in spans)
    return StepTaken(start, end, busy, waited, loss if rank == world - 1 else None, grads)
