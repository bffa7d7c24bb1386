"""A run refuses, in one line and before its first step, values that cannot work and ranks that disagree."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import pytest

from pipeclock.app import cli
from pipeclock.app.train import TrainConfig, train
from tests.distributed import run_ranks


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "--steps must be a whole number >= 1, got 0"),
        (["--steps", "-5"], "--steps must be a whole number >= 1, got -5"),
        (["--microbatches", "0"], "--microbatches must be a whole number >= 1, got 0"),
        (["--hidden", "0"], "--hidden must be a whole number >= 1, got 0"),
        (["--timeout", "0"], "--timeout must be > 0, got 0.0"),
        (["--timeout", "-1"], "--timeout must be > 0, got -1.0"),
        (["--batch-size", "0"], "--batch-size must be a whole number >= 1, got 0"),
        (["--lr", "0"], "--lr must be > 0, got 0.0"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    ],
)
def test_a_value_that_cannot_work_is_one_line_and_exit_2(flags, message):
    stderr = io.StringIO()
    with redirect_stderr(stderr), redirect_stdout(io.StringIO()):
        code = cli.main(["train", *flags])
    assert code == 2 and stderr.getvalue() == f"pipeclock train: error: {message}\n"


def disagreeing(rank: int, world: int) -> str:
    layers = 8 if rank == 0 else 6
    steps = 3 if rank == 0 else 4
    try:
        train(TrainConfig(hidden=16, layers=layers, steps=steps, batch_size=8))
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_started_with_different_settings_all_refuse_naming_each_ranks_values():
    outcomes = run_ranks(disagreeing, 2, timeout=10)
    for outcome in outcomes:
        assert outcome.ok, outcome.error
        assert outcome.value == (
            f"rank {outcome.rank}: ranks disagree on the run: "
            "--layers is 8 on rank 0 and 6 on rank 1; --steps is 3 on rank 0 and 4 on rank 1"
        )
