"""The central property: a pipelined step leaves the one-process model's loss and gradients.

For every schedule, stage count p, micro-batch count m, even and uneven batches, on ShardedMLP (narrow,
and wide enough that a backward W follows at once is split into B then W), on an ``nn.Sequential``
whose widths and layer kinds change, and on one of modules whose weights B must take itself (an output
overwritten in place, a tuple returned, weights read without a call), each rank's ``.grad`` equals
(relative difference <= 1e-5) the gradient the whole model computes on one process for the whole batch.
Real gloo processes, one launch per stage count, with every case of that stage count run inside it.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeclock import schedule
from pipeclock.engine.backward import ParameterOutputs, in_place_saves_enough
from pipeclock.model import ShardedMLP, split_sequential
from pipeclock.training.loop import TrainConfig, train
from tests.distributed import run_ok

TOLERANCE = 1e-5
SCHEDULE_CHUNKS = {
    "naive": [1],
    "gpipe": [1],
    "1f1b": [1],
    "interleaved-1f1b": [2, 3],
    "zb-h1": [1],
    "zb-v": [2],
    "dualpipev": [2],
}
V_PLACED = ("zb-v", "dualpipev")
WIDE = 192  # 192 x 192 weights: past backward.IN_PLACE_PAYS_FROM, so GPipe's and 1F1B's B run B then W


def varied_sequential(seed: int = 0) -> nn.Sequential:
    """Widths change at every Linear, with GELU, LayerNorm, Tanh and SiLU between: a non-MLP stage mix."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 10), nn.GELU(), nn.LayerNorm(10), nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 7),
        nn.SiLU(), nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3),
    )  # fmt: skip


class PairLinear(nn.Linear):
    """A module with weights that returns a tuple (a router's logits and their top choices, say)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(x)
        return out, out.argmax(-1)


class FirstOf(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[0]


class ReadsWeights(nn.Module):
    """Uses a child Linear's weights without calling it (as a fused kernel reads ``conv1d.weight``)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.linear.weight, self.linear.bias).tanh()


def inplace_sequential(seed: int = 0) -> nn.Sequential:
    """Modules whose weights a split backward cannot leave to W: a Linear whose output a
    ReLU(inplace=True) overwrites, one returning a tuple, one whose weights are read without a call."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(2):
        layers += [nn.Linear(6, 6), nn.ReLU(inplace=True), FirstOf(PairLinear(6, 6)), ReadsWeights(6)]
    return nn.Sequential(*layers, nn.Linear(6, 6))


def test_only_a_wide_enough_linear_stage_splits_a_backward_that_w_follows_at_once():
    narrow, wide = ShardedMLP(8, 4), ShardedMLP(WIDE, 4)
    assert ParameterOutputs([wide], defers_weights=False).split_pays
    assert not ParameterOutputs([narrow], defers_weights=False).hooked
    assert not any(module._forward_hooks for module in narrow.modules()), "an unused hook costs a call"
    assert ParameterOutputs([ShardedMLP(8, 4)], defers_weights=True).hooked, "a deferred W needs them"
    assert not ParameterOutputs([varied_sequential()], defers_weights=False).split_pays  # LayerNorm


def test_a_wide_stage_splits_only_micro_batches_small_next_to_its_weights():
    wide = ShardedMLP(WIDE, 4)
    outputs = ParameterOutputs([wide], defers_weights=False)
    for rows, splits in ((WIDE // 8, True), (WIDE // 4, True), (WIDE // 2, False)):
        with outputs.capture() as captured:
            wide(torch.randn(rows, WIDE))
        assert in_place_saves_enough(captured) == splits, rows


def test_a_forward_whose_backward_runs_whole_captures_nothing_once_its_shape_is_known():
    """Holding every layer's output through a forward, only to drop it after, cost fresh memory (page
    faults) on every step: only the first forward of a shape captures, to decide."""
    for rows, splits in ((WIDE // 2, False), (WIDE // 8, True)):
        stage = ShardedMLP(WIDE, 4)
        pipe = schedule.Pipeline(stage, "gpipe", 2)
        outputs, entered = pipe.parameter_outputs, []
        first_linear = next(m for m in stage.modules() if isinstance(m, nn.Linear))
        first_linear.register_forward_hook(
            lambda *_, entered=entered, outputs=outputs: entered.extend([1] * (outputs._captured is not None))
        )
        batch = torch.randn(2 * rows, WIDE)
        for _ in range(3):
            pipe.step(batch, batch)
        assert list(outputs.split_pays_for.values()) == [splits]
        assert len(entered) == (6 if splits else 1), rows


def microbatch_counts(p: int) -> list[int]:
    return sorted({1, 2, 3, p, 2 * p + 1})


def whole_model(model_kind: str) -> tuple[nn.Module, int, int]:
    """The one-process reference of ``model_kind``, with its input and output widths."""
    if model_kind in ("mlp", "wide"):
        width = WIDE if model_kind == "wide" else 8
        return ShardedMLP(width, 16, seed=5), width, width
    make = {"sequential": varied_sequential, "inplace": inplace_sequential}[model_kind]
    return make(), 6, (3 if model_kind == "sequential" else 6)


def build(model_kind: str, rank: int, p: int, chunks: int, placement: str = "loop"):
    """(this rank's modules, the one-process reference, input width, output width)."""
    reference, width_in, width_out = whole_model(model_kind)
    if model_kind in ("mlp", "wide"):
        parts = ShardedMLP.for_rank(width_in, 16, rank, p, chunks, seed=5, placement=placement)
        return parts, reference, width_in, width_out
    make = {"sequential": varied_sequential, "inplace": inplace_sequential}[model_kind]
    parts = split_sequential(make(), rank, p, chunks, placement=placement)
    return (parts if chunks > 1 else [parts]), reference, width_in, width_out


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@functools.cache
def pristine(model_kind: str, rank: int, p: int, chunks: int, placement: str) -> list[nn.Module]:
    """This rank's modules as built, kept unused: each case runs on a fresh copy (no gradients, no
    hooks), without building them again (the layers' seeded initialisation costs more than a step)."""
    return build(model_kind, rank, p, chunks, placement)[0]


@functools.cache
def one_process(model_kind: str, m: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, float, dict]:
    """The batch of a case, and the whole model's loss and gradients on it, on one process: what every
    schedule, placement and chunk count with this model, m and batch must reproduce (computed once).
    Each gradient comes with its largest magnitude, the scale its differences are measured against."""
    reference, width_in, width_out = whole_model(model_kind)
    generator = torch.Generator().manual_seed(batch * 31 + m)
    inputs, targets = (
        torch.randn(batch, width_in, generator=generator),
        torch.randn(batch, width_out, generator=generator),
    )
    want_loss = F.mse_loss(reference(inputs), targets)
    want_loss.backward()
    grads = {
        name: (param.grad, param.grad.abs().max().clamp_min(1e-12))
        for name, param in reference.named_parameters()
    }
    return inputs, targets, want_loss.item(), grads


def one_case(rank: int, p: int, name: str, chunks: int, m: int, batch: int, model_kind: str) -> float:
    """Worst relative gap (loss and every gradient) between the pipeline and the reference."""
    placement = "v" if name in V_PLACED else "loop"
    modules = copy.deepcopy(pristine(model_kind, rank, p, chunks, placement))
    inputs, targets, want_loss, wanted = one_process(model_kind, m, batch)
    loss = schedule.Pipeline(modules, name, m, F.mse_loss).step(inputs, targets)
    gaps = [abs(loss - want_loss) / abs(want_loss)]
    for module in modules:
        for param_name, param in module.named_parameters():
            want, scale = wanted[param_name]  # relative_gap's, the reference's largest value computed once
            gaps.append(((param.grad - want).abs().max() / scale).item())
    return max(gaps)


def all_cases_on(rank: int, p: int) -> dict[tuple, float]:
    results = {}
    for name, chunk_options in SCHEDULE_CHUNKS.items():
        for chunks in chunk_options:
            for m in microbatch_counts(p):
                for batch in (4 * m, 4 * m + 3):  # even, then uneven micro-batches
                    for model_kind in ("mlp", "wide", "sequential", "inplace"):
                        if model_kind not in ("mlp", "wide") and p * chunks > 9:
                            continue
                        key = (name, chunks, m, batch, model_kind)
                        results[key] = one_case(rank, p, *key)
    return results


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_schedule_leaves_the_one_process_gradients(p):
    per_rank = run_ok(all_cases_on, p, deadline=420)
    cases = per_rank[0].keys()
    assert len(cases) >= len(SCHEDULE_CHUNKS) * len(microbatch_counts(p)) * 2 * 2
    worst = {case: max(results[case] for results in per_rank) for case in cases}
    bad = {case: gap for case, gap in worst.items() if gap > TOLERANCE}
    assert not bad, f"gradients differ from the one-process model in {len(bad)} cases: {bad}"


def two_sgd_steps(rank: int, p: int, name: str) -> list[float]:
    """Two optimizer steps in a row: the weights after them, compared with the reference's."""
    chunks = SCHEDULE_CHUNKS[name][0]
    modules, reference, _, _ = build("mlp", rank, p, chunks, "v" if name in V_PLACED else "loop")
    pipe = schedule.Pipeline(modules, name, 3)
    mine = torch.optim.SGD([q for mod in modules for q in mod.parameters()], lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(10, 8, generator=generator), torch.randn(10, 8, generator=generator)
        for optimizer in (mine, theirs):
            optimizer.zero_grad()
        pipe.step(inputs, targets)
        F.mse_loss(reference(inputs), targets).backward()
        mine.step()
        theirs.step()
    wanted = dict(reference.named_parameters())
    return [relative_gap(q, wanted[n]) for mod in modules for n, q in mod.named_parameters()]


def two_steps_every_schedule(rank: int, p: int) -> dict[str, float]:
    return {name: max(two_sgd_steps(rank, p, name)) for name in schedule.SCHEDULES}


def test_two_optimizer_steps_in_a_row_match_the_one_process_model():
    per_rank = run_ok(two_steps_every_schedule, 3)
    worst = {name: max(r[name] for r in per_rank) for name in schedule.SCHEDULES}
    assert all(gap <= TOLERANCE for gap in worst.values()), worst


def two_steps_without_zeroing(rank: int, p: int, name: str) -> list[float]:
    """Two steps with no zero_grad between: the second adds to the gradients the first left."""
    chunks = SCHEDULE_CHUNKS[name][0]
    modules, reference, _, _ = build("mlp", rank, p, chunks, "v" if name in V_PLACED else "loop")
    pipe = schedule.Pipeline(modules, name, 3)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(10, 8, generator=generator), torch.randn(10, 8, generator=generator)
        pipe.step(inputs, targets)
        F.mse_loss(reference(inputs), targets).backward()
    wanted = dict(reference.named_parameters())
    return [relative_gap(q.grad, wanted[n].grad) for mod in modules for n, q in mod.named_parameters()]


def accumulation_every_schedule(rank: int, p: int) -> dict[str, float]:
    return {name: max(two_steps_without_zeroing(rank, p, name)) for name in schedule.SCHEDULES}


def test_a_step_adds_to_the_gradients_already_there_as_backward_does():
    per_rank = run_ok(accumulation_every_schedule, 2)
    worst = {name: max(r[name] for r in per_rank) for name in schedule.SCHEDULES}
    assert all(gap <= TOLERANCE for gap in worst.values()), worst


def twenty_steps(rank: int, p: int) -> dict[str, list[float]]:
    return {
        name: train(TrainConfig(schedule=name, microbatches=4, hidden=32, batch_size=18, steps=20)).losses
        for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
    }


def one_process_losses(steps: int = 20) -> list[float]:
    from pipeclock.models.regression import SyntheticRegression

    model, data = ShardedMLP(32, 16), SyntheticRegression(32)
    optimizer = torch.optim.Adam(model.parameters(), lr=TrainConfig().lr)
    losses = []
    for step in range(steps):
        inputs, targets = data.batch(step, 18)
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_twenty_step_training_run_follows_the_one_process_loss_curve():
    per_rank = run_ok(twenty_steps, 2)
    expected = one_process_losses()
    assert expected[-1] < expected[0] / 2, "the run really learns"
    for name, losses in per_rank[0].items():
        assert losses == per_rank[1][name], "every rank reports the same loss"
        gaps = [abs(a - b) / b for a, b in zip(losses, expected, strict=True)]
        assert max(gaps) <= TOLERANCE, (name, max(gaps))
