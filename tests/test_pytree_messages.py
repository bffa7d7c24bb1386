"""Stages hand each other pytrees: tuples and dicts of tensors, integer leaves included.

Floating leaves carry gradients back, integer leaves travel forward only; the result is the one-process
model's, for every schedule. A stage that cannot take what the previous one hands it fails with one error
naming both stages. ``evaluate`` gives the one-process loss with nothing held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeclock import schedule
from pipeclock.engine import pytree
from pipeclock.engine.orchestrator import StageError
from pipeclock.models.split import split_sequential
from tests.distributed import run_ok, run_ranks

TOLERANCE = 1e-5


class ToTuple(nn.Module):
    """x -> (hidden, counts): a float leaf and an int64 leaf that the next stage uses."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), (x > 0).sum(dim=1)


class TupleToDict(nn.Module):
    """(hidden, counts) -> {"h": ..., "gate": ..., "counts": ...}: two float leaves and an int leaf."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, counts = inputs
        return {"h": torch.tanh(self.linear(hidden)), "gate": hidden.sigmoid(), "counts": counts}


class DictToTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        mixed = inputs["h"] * inputs["gate"] + inputs["counts"][:, None].float() / 6
        return self.linear(mixed)


def pytree_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(ToTuple(), TupleToDict(), DictToTensor())


def pytree_cases(rank: int, p: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 6, generator=generator), torch.randn(7, 3, generator=generator)
    reference = pytree_model()
    want = F.mse_loss(reference(x), y)
    want.backward()
    wanted = dict(reference.named_parameters())
    gaps = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        stage = split_sequential(pytree_model(), rank, p)
        loss = schedule.Pipeline(stage, name, 3).step(x, y)
        grads = [
            ((q.grad - wanted[n].grad).abs().max() / wanted[n].grad.abs().max()).item()
            for n, q in stage.named_parameters()
        ]
        gaps[name] = max([abs(loss - want.item()) / want.item(), *grads])
    return gaps


def test_tuples_and_dicts_with_integer_leaves_pass_between_stages_with_one_process_gradients():
    per_rank = run_ok(pytree_cases, 3)
    worst = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    assert all(gap <= TOLERANCE for gap in worst.values()), worst


class WantsTensor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def mismatched_structure(rank: int, p: int) -> str:
    stage = ToTuple() if rank == 0 else WantsTensor()
    x, y = torch.randn(4, 6), torch.randn(4, 8)
    try:
        schedule.Pipeline(stage, "gpipe", 2).step(x, y)
    except StageError as error:
        return str(error)
    except Exception as error:  # the first stage sees its peer leave
        return f"{type(error).__name__}"
    return "no error"


def test_a_stage_that_cannot_take_the_structure_it_receives_names_both_stages():
    messages = run_ok(mismatched_structure, 2, timeout=5)
    assert messages[1].startswith("rank 1: F0 (virtual stage 1) failed:"), messages[1]
    assert "its input came from stage 0 (rank 0) as tuple(float32[2, 8], int64[2])" in messages[1]


def evaluation(rank: int, p: int) -> dict:
    generator = torch.Generator().manual_seed(4)
    x, y = torch.randn(9, 6, generator=generator), torch.randn(9, 3, generator=generator)
    stage = split_sequential(pytree_model(), rank, p)
    pipe = schedule.Pipeline(stage, "1f1b", 3)
    evaluated = pipe.evaluate(x, y)
    evaluated_peak = pipe.meter.peak
    grads_after_evaluate = [q.grad for q in stage.parameters()]
    trained = pipe.step(x, y)
    return {
        "evaluated": evaluated,
        "trained": trained,
        "evaluated_peak": evaluated_peak,
        "trained_peak": pipe.meter.peak,
        "no_grads": all(g is None for g in grads_after_evaluate),
    }


def test_evaluate_returns_the_one_process_loss_on_every_rank_and_holds_no_activations():
    per_rank = run_ok(evaluation, 3)
    generator = torch.Generator().manual_seed(4)
    x, y = torch.randn(9, 6, generator=generator), torch.randn(9, 3, generator=generator)
    with torch.no_grad():
        want = F.mse_loss(pytree_model()(x), y).item()
    for result in per_rank:
        assert abs(result["evaluated"] - want) <= TOLERANCE * want
        assert result["evaluated"] == result["trained"], "dropout-free: the same forward"
        assert result["evaluated_peak"] == 0 and result["no_grads"]
        assert result["trained_peak"] > 0, "the meter does see what a training step holds"


def test_a_header_describes_structure_shapes_and_dtypes_and_decodes_to_the_same():
    tree = {
        "h": torch.zeros(2, 3),
        "ids": (torch.zeros(2, dtype=torch.int64), torch.ones(1, dtype=torch.bool)),
    }
    spec, shapes = pytree.decode_header(pytree.encode_header(tree, torch.device("cpu")))
    assert shapes == [((2, 3), torch.float32), ((2,), torch.int64), ((1,), torch.bool)]
    rebuilt = pytree.unflatten([torch.zeros(s, dtype=d) for s, d in shapes], spec)
    assert (
        pytree.describe(rebuilt)
        == pytree.describe(tree)
        == "dict(h=float32[2, 3], ids=tuple(int64[2], bool[1]))"
    )


class _NumberOut(nn.Module):
    """A stage that hands on a Python number beside its tensor: ``(x, 3)``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x[0] if isinstance(x, tuple) else x), 3


def _python_value_errors(rank: int, world: int) -> str:
    """A V on one rank: its two chunks hand over in memory."""
    try:
        schedule.Pipeline([_NumberOut(), _NumberOut()], schedule.zb_v, 2).step(
            torch.randn(4, 4), torch.randn(4, 4)
        )
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_stage_that_hands_a_python_value_to_a_stage_on_its_own_rank_gets_the_engines_own_message():
    """Handed over in memory (a V on one rank), the output is checked as a message to another rank is."""
    message = run_ranks(_python_value_errors, 1, timeout=10)[0].value
    wanted = "StageError: rank 0: F0 (virtual stage 0) failed: the output of stage 0 must be a tensor"
    assert message.startswith(wanted), message
    assert message.endswith("found leaves of type int"), message
