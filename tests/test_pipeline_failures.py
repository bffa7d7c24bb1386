"""Fail loud, never hang: bad configurations, dead peers, hung peers and broken stages.

Every case runs on real gloo processes. A configuration error is the same ``ValueError`` on every rank
(a batch that cannot run: ``BatchRefused``), raised before any pipeline message; a peer that dies or
hangs makes the others fail within the timeout with a message that names the ranks.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
from torch import nn

from pipeclock import comms, parallel, schedule
from pipeclock.engine.actions import parse_schedule
from pipeclock.engine.orchestrator import StageError
from pipeclock.model import ShardedMLP
from pipeclock.observe.simulate import DeadlockError
from tests.distributed import run_ranks


def _error_of(build_and_step) -> str:
    try:
        build_and_step()
    except (ValueError, DeadlockError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _deadlocking(p: int, m: int):
    """Rank 0 wants B0 before its own F0: it can never start."""
    return parse_schedule(["B0 F0", "F0 B0"])


def _bad_configurations(rank: int, world: int) -> dict[str, str]:
    stage = ShardedMLP(4, 4, rank, world)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    cases = {
        "zero micro-batches": lambda: schedule.Pipeline(stage, "1f1b", 0),
        "unknown schedule": lambda: schedule.Pipeline(stage, "fastest", 2),
        "chunks the schedule cannot use": lambda: schedule.Pipeline([stage, stage], "1f1b", 2),
        "custom schedule that deadlocks": lambda: schedule.Pipeline(stage, _deadlocking, 1),
        "batch smaller than m": lambda: schedule.Pipeline(stage, "gpipe", 8).step(x, y),
        "ranks disagree on m": lambda: schedule.Pipeline(stage, "gpipe", 2 + rank).step(x, y),
        "no inputs on the first stage": lambda: schedule.Pipeline(stage, "gpipe", 2).step(None, y),
        "targets of another batch": lambda: schedule.Pipeline(stage, "gpipe", 2).step(x, y[:5]),
        "inputs of two batch sizes": lambda: schedule.Pipeline(stage, "gpipe", 2).step((x, x[:5]), y),
        "inputs that are not tensors": lambda: schedule.Pipeline(stage, "gpipe", 2).step(x.tolist(), y),
    }
    errors = {name: _error_of(case) for name, case in cases.items()}
    errors["a good batch after rejected ones"] = _good_step_after_rejected_ones(stage, x, y)
    return errors


def _good_step_after_rejected_ones(stage: nn.Module, x: torch.Tensor, y: torch.Tensor) -> str:
    """A pipeline that refused batches takes the next good one as if nothing had happened."""
    used, fresh = schedule.Pipeline(stage, "1f1b", 2), schedule.Pipeline(stage, "1f1b", 2)
    for bad in ((None, y), (x, y[:5]), ((x, x[:5]), y), (x[:1], y[:1])):
        if _error_of(lambda bad=bad: used.step(*bad)) == "no error":
            return f"accepted {bad!r}"
    losses = (used.step(x, y), fresh.step(x, y))
    return "equal" if losses[0] == losses[1] else f"losses {losses}"


def test_bad_configurations_fail_on_every_rank_with_one_clear_message():
    outcomes = run_ranks(_bad_configurations, 2, timeout=10)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    expected = {
        "zero micro-batches": "ValueError: rank {r}: num_microbatches must be an integer in 1..65535, got 0",
        "unknown schedule": "ValueError: rank {r}: unknown schedule 'fastest'; known schedules: "
        "naive, gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v, dualpipev",
        "chunks the schedule cannot use": "ValueError: rank {r}: schedule '1f1b' has one chunk per rank; "
        "cannot use chunks=2",
        "batch smaller than m": "BatchRefused: rank {r}: a batch of 6 samples cannot be split into 8 "
        "micro-batches (each needs at least one sample)",
        "ranks disagree on m": "ValueError: rank {r}: ranks disagree on micro-batches, chunks or schedule "
        "(rank 0: m=2, chunks=1; rank 1: m=3, chunks=1)",
        "no inputs on the first stage": "BatchRefused: rank {r}: the first stage (rank 0) was given no "
        "inputs tensor",
        "targets of another batch": "BatchRefused: rank {r}: 6 inputs but 5 targets in the batch",
    }
    for outcome in outcomes:
        for name, message in expected.items():
            assert outcome.value[name] == message.format(r=outcome.rank), name
        unreadable = outcome.value["inputs of two batch sizes"], outcome.value["inputs that are not tensors"]
        if outcome.rank == 0:  # the rank given them says what is wrong; the others, where to look
            assert unreadable[0].startswith("BatchRefused: rank 0: the leaves of the inputs disagree on")
            assert unreadable[1] == (
                "BatchRefused: rank 0: the inputs must be a tensor, or a tuple, list or dict of tensors; "
                "it holds a float"
            )
        else:
            told = "the first stage (rank 0) could not read its inputs (its own error says why)"
            assert set(unreadable) == {f"BatchRefused: rank 1: {told}"}
        assert outcome.value["a good batch after rejected ones"] == "equal"
        assert outcome.value["custom schedule that deadlocks"].startswith(
            "DeadlockError: the schedule deadlocks; no rank can move:\n  rank 0: stuck at B0"
        )


def _what_happens_in_order(rank: int, world: int) -> dict[str, object]:
    stage = ShardedMLP(4, 4, rank, world)
    pipe, events = schedule.Pipeline(stage, "gpipe", 2), []
    stage.register_forward_pre_hook(lambda *_: events.append("forward"))
    read, send = pipe.ends.batch_sizes, pipe.messenger._send
    pipe.ends.batch_sizes = lambda: events.append("sizes read") or read()
    pipe.messenger._send = lambda key, pending: events.append("message") or send(key, pending)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    pipe.step(x, y)
    good = events[:3]
    events.clear()
    error = _error_of(lambda: pipe.step(x, y[:5]))
    return {"good": good, "refused": events, "error": error}


def test_the_first_stage_computes_while_the_batch_size_travels_and_checks_it_before_any_message():
    first, last = (o.value for o in run_ranks(_what_happens_in_order, 2, timeout=10))
    assert first["good"] == ["forward", "sizes read", "message"]
    assert last["good"] == ["sizes read", "forward", "forward"]  # the last stage sends nothing forward
    assert first["refused"] == ["forward", "sizes read"] and last["refused"] == ["sizes read"]
    for rank, outcome in enumerate((first, last)):
        assert outcome["error"] == f"BatchRefused: rank {rank}: 6 inputs but 5 targets in the batch"


def _one_replica_refuses_its_batch(rank: int, world: int) -> str:
    mesh = parallel.init_mesh(2)  # dp 2 x pp 1: rank 0 and rank 1 are replicas of a one-stage pipeline
    replicas = parallel.data_parallel([ShardedMLP(4, 4, 0, 1)], mesh, "ddp")
    pipe = schedule.Pipeline(replicas.chunks, "gpipe", 2, group=mesh.get_group("pp"), replicas=replicas)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    return _error_of(lambda: pipe.step(None if rank == 0 else x, y))


def test_a_batch_one_replica_refuses_is_an_error_on_every_replica_not_a_wait():
    first, second = (o.value for o in run_ranks(_one_replica_refuses_its_batch, 2, timeout=10))
    assert first == "BatchRefused: rank 0: the first stage (rank 0) was given no inputs tensor"
    assert second == (
        "BatchRefused: rank 1: data-parallel replica 0 refused its batch (its ranks' own errors say why)"
    )


class _DiesOnThirdForward(nn.Module):
    """A stage whose process crashes (no goodbye) in the middle of the second step."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 6:
            os._exit(9)
        return self.inner(x)


class _HangsOnce(nn.Module):
    """A stage that hangs in its second forward until ``released`` exists (at most a minute): however
    slow a busy machine makes its peer, the peer meets the hang, and nobody waits longer than needed."""

    def __init__(self, inner: nn.Module, released: Path):
        super().__init__()
        self.inner, self.calls, self.released = inner, 0, released

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            end = time.monotonic() + 60
            while not self.released.exists() and time.monotonic() < end:
                time.sleep(0.05)
        return self.inner(x)


def _train_until_failure(
    rank: int, world: int, victim: int, kind: str, released: Path | None = None
) -> tuple[str, str, float]:
    stage: nn.Module = ShardedMLP(8, 6, rank, world)
    if rank == victim:
        stage = _DiesOnThirdForward(stage) if kind == "dies" else _HangsOnce(stage, released)
    pipe = schedule.Pipeline(stage, "1f1b", 4)
    start = time.monotonic()
    try:
        for _ in range(5):
            start = time.monotonic()
            pipe.step(torch.randn(8, 8), torch.randn(8, 8))
    except comms.CommError as error:
        return type(error).__name__, str(error), time.monotonic() - start
    finally:
        if released is not None:
            released.touch()
    return "no error", "", 0.0


def test_a_peer_that_dies_mid_step_makes_its_neighbours_fail_fast_naming_it():
    outcomes = run_ranks(_train_until_failure, 3, 1, "dies", timeout=20, linger=False)
    assert outcomes[1].exitcode == 9
    for rank in (0, 2):
        kind, message, seconds = outcomes[rank].value
        assert kind == "PeerGoneError" and seconds < 10, (rank, kind, message, seconds)
        assert message.startswith(f"rank {rank}: lost the connection to rank 1 while receiving the ")


def test_a_peer_that_hangs_mid_step_is_a_timeout_within_the_timeout(tmp_path):
    outcomes = run_ranks(_train_until_failure, 2, 1, "hangs", tmp_path / "released", timeout=2, linger=False)
    kind, message, seconds = outcomes[0].value
    # at least the timeout, and far less than the minute the peer would hang
    assert kind == "CommTimeoutError" and 2.0 <= seconds < 30.0, (kind, message, seconds)
    assert message.startswith(
        "rank 0: receiving the gradient of micro-batch 1 for stage 0 from rank 1 did not"
    )
    assert "within 2s" in message


def _mismatched_stages(rank: int, world: int) -> tuple[str, str]:
    stage = nn.Linear(4, 4) if rank == 0 else nn.Linear(5, 3)  # rank 1 expects width 5, gets 4
    try:
        schedule.Pipeline(stage, "gpipe", 2).step(torch.randn(4, 4), torch.randn(4, 3))
    except (StageError, comms.CommError) as error:
        return type(error).__name__, str(error)
    return "no error", ""


def test_a_stage_that_cannot_take_its_input_names_its_rank_and_action():
    outcomes = run_ranks(_mismatched_stages, 2, timeout=20, linger=False)
    kind, message = outcomes[1].value
    assert kind == "StageError"
    assert message.startswith(
        "rank 1: F0 (virtual stage 1) failed: mat1 and mat2 shapes cannot be multiplied"
    )
    kind, message = outcomes[0].value
    assert kind == "PeerGoneError" and message.startswith("rank 0: lost the connection to rank 1")


def _split_backward_with_inplace_relu(rank: int, world: int) -> float:
    """Rank 1's I is split from its W (its gradient goes on to rank 0), and its Linear's output is then
    overwritten by the ReLU: the largest gap of its gradients from one process's."""
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    stage = copy.deepcopy(whole[2 * rank : 2 * rank + 2])
    inputs, targets = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 4)
    schedule.Pipeline(stage, "zb-h1", 2).step(inputs, targets)
    torch.nn.functional.mse_loss(whole(inputs), targets).backward()
    pairs = zip(stage.parameters(), whole[2 * rank : 2 * rank + 2].parameters(), strict=True)
    return max((got.grad - want.grad).abs().max().item() for got, want in pairs)


def test_a_split_backward_takes_the_weights_of_an_output_overwritten_in_place_in_b():
    """The overwritten output's own gradient is gone, so its module's weights get theirs in B: exact."""
    outcomes = run_ranks(_split_backward_with_inplace_relu, 2, timeout=20)
    assert all(outcome.ok for outcome in outcomes), [outcome.error for outcome in outcomes]
    assert max(outcome.value for outcome in outcomes) < 1e-6
