"""Bad input, as a table: each kind of wrong usage gets one clear error that names the cause and the rank.

Every case runs on real gloo processes, many cases per launch: a case whose ranks all fail at the same
point leaves the process group in step for the next one, and a mistake only one rank would notice runs
on a pipeline of that rank alone. Each case says what its message must name; the exact messages are the
table in docs/errors.md, which `test_the_errors_page_shows_what_the_code_prints` compares with what
the code printed here (``PIPECLOCK_WRITE_ERRORS=1`` writes the page's table instead).
"""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore

from pipeclock import comms, schedule
from pipeclock.checkpoints.choice import step_of
from pipeclock.engine.actions import parse_schedule
from pipeclock.engine.csv_schedule import save_csv
from pipeclock.engine.orchestrator import StageError
from pipeclock.observe.sizes import format_bytes
from pipeclock.training.loop import TrainConfig, train
from tests.distributed import free_port, run_ranks
from tests.test_pipeline_failures import _bad_configurations

PAGE = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
TABLE_START, TABLE_END = "<!-- errors table: tests/test_bad_input.py -->", "<!-- end errors table -->"
SMALL = dict(hidden=16, layers=4, steps=2, batch_size=8)
NAN_STEPS = 6  # the run that blows up asks for this many steps, and saves a checkpoint after each


@dataclass(frozen=True)
class Case:
    usage: str  # the wrong usage, as the page lists it
    names: tuple[str, ...]  # what its message must say besides the rank: the flags or the thing at fault
    reporter: int | None = None  # the one rank that reports it; None: every rank, in the same words
    names_rank: bool = True  # False: a mistake in the flags or the schedule alone, the same on any rank


# --- a training run asked for something that cannot work: every rank stops, at the same point ---------

# Each case's ``TrainConfig`` fields (files are in the launch's folder), and what rank 1 asks differently.
TRAIN_CASES: list[tuple[Case, dict, dict]] = [
    (Case("ranks started with different `--layers` and `--steps`",
          ("--layers is 8 on rank 0 and 6 on rank 1", "--steps is 3 on rank 0 and 4 on rank 1")),
     dict(SMALL, layers=8, steps=3), dict(layers=6, steps=4)),
    (Case("`--dp` that does not divide the processes", ("--dp 3", "2 process(es)")), dict(SMALL, dp=3), {}),
    (Case("a batch too small for `--dp` x `--microbatches`", ("--batch-size 4", "--dp 2", "--microbatches"),
          names_rank=False),
     dict(SMALL, batch_size=4, dp=2, microbatches=4), {}),
    (Case("a batch smaller than `--microbatches`", ("batch of 4 samples", "8 micro-batches")),
     dict(SMALL, batch_size=4, microbatches=8), {}),
    (Case("`--chunks` for a schedule of one chunk per rank", ("'1f1b'", "chunks=2")),
     dict(SMALL, chunks=2), {}),
    (Case("fewer layers than stages x chunks", ("3 layers", "4 stages")),
     dict(SMALL, layers=3, schedule="interleaved-1f1b"), {}),
    (Case("a GPT whose `--dim` is not divisible by `--heads`", ("dim 30", "heads 4")),
     dict(model="gpt", dim=30, heads=4, layers=2, steps=1, batch_size=4, seq_len=16), {}),
    (Case("a `--schedule-csv` for another number of ranks", ("three.csv", "3 ranks, not 2")),
     dict(SMALL, schedule_csv="three.csv"), {}),
    (Case("a `--schedule-csv` and other `--microbatches`", ("two.csv has 4 micro-batches", "--microbatches"),
          names_rank=False),
     dict(SMALL, schedule_csv="two.csv", microbatches=2), {}),
    (Case("`--tp 0`", ("--tp must be a whole number >= 1, got 0",), names_rank=False), dict(SMALL, tp=0), {}),
    (Case("`--dp` x `--tp` that does not divide the processes", ("--dp 1 x --tp 4 = 4", "2 process(es)")),
     dict(SMALL, tp=4), {}),
    (Case("`--tp` that does not divide a GPT's heads", ("--tp 2", "3 attention heads")),
     dict(model="gpt", dim=12, heads=3, layers=2, steps=1, batch_size=4, seq_len=16, tp=2), {}),
    (Case("a `--tp-plan` naming a module the model lacks", ("--tp-plan absent.json", "h*.attn.qkv")),
     dict(model="gpt", dim=16, heads=2, layers=2, steps=1, batch_size=4, seq_len=16, tp=2,
          tp_plan="absent.json"), {}),
    (Case("`--data-parallel ddp` with `--tp`", ("--data-parallel ddp", "--tp"), names_rank=False),
     dict(SMALL, dp=2, tp=2, data_parallel="ddp"), {}),
    (Case("a model too large for memory", ("does not fit on rank 0", "planner estimates", "but it has")),
     dict(hidden=200_000, layers=64, steps=1, batch_size=8), {}),
    (Case("the loss going NaN (a learning rate that blows up)", ("the loss is nan at step", "--lr")),
     dict(SMALL, lr=1e30, steps=NAN_STEPS, checkpoint_dir="nan", checkpoint_every=1), {}),
]  # fmt: skip

# --- the library used wrongly -------------------------------------------------------------------------

LIBRARY_CASES = [
    Case("a loss function that returns a tensor per sample, not a scalar", ("loss function", "(2, 4)")),
    Case("a custom schedule that never runs a backward", ("invalid schedule", "missing B1")),
    Case("a custom schedule for another number of ranks", ("schedule is for 3 ranks, not 2",)),
    Case("`recv_tensor` expecting another shape than was sent", ("(5,)", "(4, 4)", "rank 0"), reporter=1),
]
STOPPED_PEER = Case("a peer that stopped while this rank waits on it", ("rank 1",), reporter=0)

# tests/test_pipeline_failures.py's cases, run here too so that their messages reach the page.
PIPELINE_CASES = [
    Case("zero micro-batches", ("num_microbatches", "got 0")),
    Case("an unknown schedule name", ("'fastest'", "known schedules")),
    Case("chunks a schedule cannot use", ("'1f1b'", "chunks=2")),
    Case("a custom schedule that deadlocks", ("deadlocks",), names_rank=False),
    Case("a batch smaller than the micro-batch count", ("6 samples", "8 micro-batches")),
    Case("ranks that disagree on the micro-batch count", ("rank 0: m=2", "rank 1: m=3")),
    Case("no inputs on the first stage", ("first stage", "no inputs")),
    Case("targets of another batch than the inputs", ("6 inputs but 5 targets",)),
    Case("inputs whose tensors disagree on the batch size", ("leaves of the inputs disagree",), reporter=0),
    Case("inputs given as a list of numbers, not tensors", ("must be a tensor", "holds a float"), reporter=0),
]
PIPELINE_KEYS = [
    "zero micro-batches",
    "unknown schedule",
    "chunks the schedule cannot use",
    "custom schedule that deadlocks",
    "batch smaller than m",
    "ranks disagree on m",
    "no inputs on the first stage",
    "targets of another batch",
    "inputs of two batch sizes",
    "inputs that are not tensors",
]

# --- ranks that never come: one ``pipeclock train`` process, alone, as a user would see it -------------

NEVER_TIMEOUT = 3  # --timeout of these runs, in seconds
NEVER_CASES = [
    Case("a rank that never starts (rank 0 waits for rank 1)", ("waited 3s", "1 of 2 ranks"), reporter=0),
    Case("rank 0 never starts (rank 1 waits for its store)", ("waited 3s", "rank 0's store"), reporter=1),
    Case("torchrun started fewer ranks than the world size says (a node that never comes)",
         ("waited 3s", "rank 1 to join", "WORLD_SIZE=2"), reporter=0),
]  # fmt: skip

ALL_CASES = (
    [case for case, _, _ in TRAIN_CASES] + LIBRARY_CASES + PIPELINE_CASES + [STOPPED_PEER] + NEVER_CASES
)


def _library_runs(rank: int, world: int) -> list:
    """What each of ``LIBRARY_CASES`` does; a mistake one rank would notice alone runs on a pipeline of
    that rank only, so the other rank does not wait for it."""
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    per_sample = lambda output, target: (output - target) ** 2  # noqa: E731 - the mistake itself
    missing_backward = lambda p, m: parse_schedule(["F0 F1 B0", "F0 F1 B0 B1"])  # noqa: E731
    for_three_ranks = lambda p, m: parse_schedule(["F0 B0"] * 3)  # noqa: E731
    return [
        lambda: schedule.Pipeline(nn.Linear(4, 4), "gpipe", 2, per_sample, group=alone).step(x, y),
        lambda: schedule.Pipeline(nn.Linear(4, 4), missing_backward, 2).step(x, y),
        lambda: schedule.Pipeline(nn.Linear(4, 4), for_three_ranks, 1).step(x, y),
        lambda: comms.send_tensor(torch.zeros(4, 4), 1) if rank == 0 else comms.recv_tensor((5,), 0),
    ]


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0]


def _outcome(run) -> str:
    """The first line of the error ``run()`` raised ("no error" if none)."""
    try:
        run()
    except (ValueError, comms.CommError, StageError) as error:
        return _first_line(error)
    return "no error"


def _wrong_usages(rank: int, world: int, tmp: str) -> dict[str, str]:
    """Every case on this rank: its usage -> the first line of the error it got."""
    os.chdir(tmp)  # files by their names, as a user gives them
    outcomes = {}
    for case, fields, on_rank_1 in TRAIN_CASES:
        asked = fields | (on_rank_1 if rank == 1 else {})
        outcomes[case.usage] = _outcome(lambda: train(TrainConfig(**asked)))  # noqa: B023 - called at once
    for case, run in zip(LIBRARY_CASES, _library_runs(rank, world), strict=True):
        outcomes[case.usage] = _outcome(run)
    pipeline = _bad_configurations(rank, world)
    for case, key in zip(PIPELINE_CASES, PIPELINE_KEYS, strict=True):
        outcomes[case.usage] = " ".join(line.strip() for line in pipeline[key].split(": ", 1)[1].splitlines())
    outcomes["peak memory (KiB)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank == 0:  # the last case: rank 1 has left (no linger), and rank 0 waits on it
        outcomes[STOPPED_PEER.usage] = _outcome(lambda: comms.gather_object("figures", "gathering figures"))
    return outcomes


def _alone(rank: int, port: int, agent_store: bool = False) -> subprocess.Popen:
    """``pipeclock train`` as rank ``rank`` of 2, started alone: the other rank never comes."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    env |= dict(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    if agent_store:  # as under torchrun: the agent holds the store, the ranks are its clients
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    flags = f"--hidden 8 --layers 2 --steps 1 --batch-size 2 --timeout {NEVER_TIMEOUT}"
    command = [sys.executable, "-m", "pipeclock", "train", *flags.split()]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _never_came(processes: list[subprocess.Popen]) -> list[dict]:
    """Each lonely process's exit code and the last line it printed on stderr."""
    found = []
    for process in processes:
        _, stderr = process.communicate(timeout=120)  # far beyond the timeout: only a hang gets here
        lines = stderr.strip().splitlines()
        found.append({"code": process.returncode, "last": lines[-1], "traceback": "Traceback" in stderr})
    return found


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[list[dict[str, str]], Path]:
    """Every case, run once: the 2-rank launch and, beside it, the lonely ranks; each rank's messages."""
    tmp = tmp_path_factory.mktemp("wrong-usages")
    save_csv(schedule.gpipe(3, 2), tmp / "three.csv")
    save_csv(schedule.gpipe(2, 4), tmp / "two.csv")
    (tmp / "absent.json").write_text('{"h*.attn.q": "colwise", "h*.attn.qkv": "colwise"}')
    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # Rank 0's port, held bound and never listened on: a connection there is refused, and no other test's
    # store can take the port meanwhile (one that did once answered rank 1 with a reset instead).
    with socket.socket() as no_store:
        no_store.bind(("127.0.0.1", 0))
        lonely = [_alone(0, free_port()), _alone(1, no_store.getsockname()[1])]
        lonely.append(_alone(0, agent.port, agent_store=True))
        outcomes = run_ranks(_wrong_usages, 2, str(tmp), timeout=10, deadline=400, linger=False)
        never_came = _never_came(lonely)
    assert all(o.ok for o in outcomes), [(o.rank, o.error, o.value) for o in outcomes if not o.ok]
    by_rank = [o.value for o in outcomes]
    for case, ran in zip(NEVER_CASES, never_came, strict=True):
        assert ran["code"] == 1 and not ran["traceback"], (case.usage, ran)
        message = ran["last"].removeprefix("pipeclock train: error: ")
        by_rank[case.reporter][case.usage] = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", message)
    return by_rank, tmp


def test_every_wrong_usage_is_one_error_naming_the_rank_and_the_cause(launch):
    by_rank, _ = launch
    for case in ALL_CASES:
        reporters = [case.reporter] if case.reporter is not None else [0, 1]
        for rank in reporters:
            message = by_rank[rank][case.usage]
            assert re.match(f"rank {rank}[: ]", message) or not case.names_rank, (case.usage, message)
            for name in case.names:
                assert name in message, (case.usage, name, message)
        if case.reporter is None:  # every rank says the same, but for its own rank
            assert _for_rank(by_rank[0][case.usage], 0) == _for_rank(by_rank[1][case.usage], 1), case.usage


def _for_rank(message: str, rank: int) -> str:
    return re.sub(f"^rank {rank}: ", "rank R: ", message)


def test_a_model_too_large_is_refused_before_anything_is_allocated(launch):
    by_rank, _ = launch
    message = by_rank[0]["a model too large for memory"]
    # rank 0 holds 32 of the 64 Linear(200000, 200000) layers: weights, gradients and Adam's two
    # moments are 16 bytes per parameter
    parameters = 32 * (200_000 * 200_000 + 200_000)
    assert f"weights, gradients and Adam state {format_bytes(16 * parameters)}" in message, message
    assert by_rank[0]["peak memory (KiB)"] < 4 * 2**20  # a few hundred MB, not the 20 TB it asked for


def test_a_loss_gone_nan_stops_every_rank_at_that_step_and_no_checkpoint_holds_it(launch):
    by_rank, tmp = launch
    step = int(re.search(r"loss is nan at step (\d+)", by_rank[0][TRAIN_CASES[-1][0].usage])[1])
    assert 0 < step < NAN_STEPS
    saved = sorted(step_of(path) for path in (tmp / "nan").iterdir())
    assert saved == list(range(1, step + 1))  # one after each step before it, none after


def test_a_peer_that_stopped_is_named_not_the_rank_that_reports_it(launch):
    by_rank, _ = launch
    message = by_rank[0][STOPPED_PEER.usage]
    assert message.startswith("rank 0: lost the connection to rank 1 while gathering figures"), message
    assert "rank 0 most likely" not in message and "is rank 0" not in message


def _table_rows(by_rank: list[dict[str, str]]) -> list[str]:
    rows = [
        "| wrong usage | reported by | the message (on the command line, after `pipeclock train: error:`) |"
    ]
    rows.append("|---|---|---|")
    for case in ALL_CASES:
        rank = case.reporter if case.reporter is not None else 0
        who = f"rank {rank}" if case.reporter is not None else "every rank"
        message = re.sub(
            r"but it has [^;]*;", "but it has (this machine's memory);", by_rank[rank][case.usage]
        )
        rows.append(f"| {case.usage} | {who} | {message.replace('|', '&#124;')} |")
    return rows


def test_the_errors_page_shows_what_the_code_prints(launch):
    by_rank, _ = launch
    text = PAGE.read_text()
    before, rest = text.split(TABLE_START + "\n", 1)
    _, after = rest.split(TABLE_END, 1)
    wanted = before + TABLE_START + "\n" + "\n".join(_table_rows(by_rank)) + "\n" + TABLE_END + after
    if os.environ.get("PIPECLOCK_WRITE_ERRORS") == "1":
        PAGE.write_text(wanted)
    assert text == wanted, "docs/errors.md: run PIPECLOCK_WRITE_ERRORS=1 pytest tests/test_bad_input.py"
