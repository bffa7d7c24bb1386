"""One case on one rank: both engines, the correctness check and the timed steps.

Both engines start from the same weights (same seed) and are fed the same batches.
Their first step is checked, not timed: the two must agree on the loss and on every gradient, or the
benchmark would compare two different computations, and it stops. Each timed step starts from zeroed
gradients after a barrier, so every engine starts every step from the same state.
"""

from __future__ import annotations

import torch

from benchmarks import engines, summary
from benchmarks.plan import Case
from pipeclock import comms
from pipeclock.engine.placement import Placement
from pipeclock.models.regression import SyntheticRegression

LOSS_TOLERANCE = 1e-5  # relative
GRAD_TOLERANCE = 1e-4  # largest gradient difference, relative to the largest gradient on the rank


class CaseRun:
    """``with_unmetered`` adds pipeclock without its activation meter, to show what metering costs."""

    def __init__(self, case: Case, with_unmetered: bool = False):
        self.case = case
        self.engines = engines.build(case, with_unmetered)
        self.data = SyntheticRegression(case.hidden, seed=0)
        self.samples: dict[str, list[engines.StepSample]] = {engine.name: [] for engine in self.engines}
        self.check: dict = {}

    def step_engine(self, engine, batch: tuple, metering: bool, keep_grads: bool = False) -> None:
        """One step of ``engine`` from no gradients; they are dropped after it unless ``keep_grads``.

        Dropping them at once keeps only one engine's gradients alive at a time: with every case of a
        group built side by side, that is the difference between fitting in memory and not.
        """
        comms.barrier("lining up the ranks before a step")
        self.samples[engine.name].append(engine.step(*batch, metering))
        if not keep_grads:
            free_grads(engine.modules)

    def timed_step(self, index: int) -> None:
        """Step ``index`` (from 1) of every engine, in turn: pipeclock first in odd steps, torch in even.

        The engine that steps right after another engine finds the heap and the caches as that one left
        them; taking turns at going first puts that on both engines alike.
        """
        if index > self.case.steps:
            return
        batch = self.batch(index)
        for engine in self.engines if index % 2 else self.engines[::-1]:
            self.step_engine(engine, batch, metering=False)

    def run_check(self) -> None:
        """Step 0 of each engine on the same batch; their losses and gradients must agree."""
        results = []
        for engine in self.engines:
            self.step_engine(engine, self.batch(0), metering=True, keep_grads=True)
            grads = [p.grad.detach().clone() for module in engine.modules for p in module.parameters()]
            free_grads(engine.modules)
            results.append((_shared_loss(self.samples[engine.name][-1].loss, self.case), grads))
        self.check = self._compare(results)

    def _compare(self, results: list) -> dict:
        if len(results) < 2:
            return {"compared": False, "loss_pipeclock": results[0][0]}
        (loss_a, grads_a), (loss_b, grads_b) = results[:2]  # pipeclock and torch
        scale = max(float(g.abs().max()) for g in grads_a) or 1.0
        mine = max(float((a - b).abs().max()) for a, b in zip(grads_a, grads_b, strict=True)) / scale
        grad_gap = max(float(g) for g in comms.all_gather(torch.tensor([mine]), "comparing gradients"))
        loss_gap = abs(loss_a - loss_b) / max(abs(loss_a), 1e-12)
        if grad_gap > GRAD_TOLERANCE or loss_gap > LOSS_TOLERANCE:
            raise RuntimeError(
                f"rank {comms.get_rank()}: {self.case}: pipeclock and torch disagree (loss {loss_a} vs "
                f"{loss_b}, largest gradient gap {grad_gap:.2e} of the largest gradient): comparison void"
            )
        return {
            "compared": True,
            "loss_pipeclock": loss_a,
            "loss_torch": loss_b,
            "loss_gap": loss_gap,
            "grad_gap": grad_gap,
        }

    def batch(self, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Batch ``index``, given only where it is read: inputs where the first stage is, targets where
        the last is (rank 0 on a V)."""
        inputs, targets = self.data.batch(index, self.case.batch)
        rank, last = comms.get_rank(), _last_rank(self.case)
        return (inputs if rank == 0 else None), (targets if rank == last else None)

    def result(self) -> dict | None:
        """The case's record on rank 0 (None elsewhere), from every rank's samples."""
        gathered = comms.gather_object(self.samples, "gathering the case's samples")
        return summary.case_result(self.case, gathered, self.check) if gathered is not None else None


def free_grads(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        module.zero_grad(set_to_none=True)


def _shared_loss(loss: float | None, case) -> float:
    """The batch loss on every rank: the last stage's rank knows it in both engines."""
    value = torch.tensor(0.0 if loss is None else loss, dtype=torch.float64)
    return float(comms.broadcast(value, _last_rank(case), "sharing the checked loss"))


def _last_rank(case) -> int:
    placement = Placement.named(case.placement, comms.get_world_size(), case.chunks)
    return placement.owner(placement.num_virtual - 1)[0]
