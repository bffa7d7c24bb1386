"""Blame the right rank: when one rank of four dies, every survivor names it, or says it cannot know.

Each survivor sees only its own neighbour's connection close; the notes the stopping ranks leave in the
store (``pipeclock.comm_blame``) lead it to the rank that died first. The store is held outside the ranks,
as torchrun's agent holds it; where it lived in a rank that died, a survivor says it cannot know
(``test_comms.py``). Four pipelines of four ranks run
at once, one per victim (``PIPECLOCK_FAULT=F:victim:1``, ``pipeclock.engine.faults``: SIGKILL at its
forward of step 1). The ranks are forked from this process, which has torch loaded already, so the
sixteen of them start in a second rather than in one interpreter start each.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import socket
import threading
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from tests.distributed import free_port

WORLD = 4
STEPS = 3


@dataclass(frozen=True)
class Scenario:
    name: str
    culprit: int  # the rank that fails first
    killed: bool  # SIGKILLed at its forward of step 1; else its loss function is wrong (its own error)
    agent_store: bool = True  # the store held outside the ranks (torchrun's agent); else in rank 0

    def reporters(self) -> list[int]:
        return [rank for rank in range(WORLD) if rank != self.culprit or not self.killed]


SCENARIOS = [Scenario(f"rank {victim} killed", victim, True) for victim in range(WORLD)] + [
    Scenario("rank 3's loss function returns a tensor per sample", 3, False),
    Scenario("rank 0 killed, and the store with it", 0, True, agent_store=False),
]


def _per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target) ** 2  # the mistake: not reduced to one number


def _rank(rank: int, port: int, scenario: Scenario, report) -> None:
    """One rank of ``scenario``: train, and report the first line of its error, as the command prints it."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0"
    )
    os.environ["LOCAL_WORLD_SIZE"] = str(WORLD * len(SCENARIOS))  # one intra-op thread each: no OpenMP pool
    if scenario.killed:
        os.environ["PIPECLOCK_FAULT"] = f"F:{scenario.culprit}:1"
    if scenario.agent_store:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as under torchrun: the store outlives the ranks
    from pipeclock import comm_blame, comms, schedule
    from pipeclock.engine import faults

    comms.init(backend="gloo", timeout=60)  # far beyond a step: only a hang reaches it
    faults.arm(WORLD)
    torch.manual_seed(rank)
    wrong = not scenario.killed and rank == scenario.culprit
    pipe = schedule.Pipeline(nn.Linear(8, 8), "1f1b", 4, _per_sample if wrong else nn.functional.mse_loss)
    try:
        for _ in range(STEPS):
            pipe.step(torch.randn(8, 8), torch.randn(8, 8))
        line = "no error"
    except Exception as error:
        line = str(error).splitlines()[0]
        comm_blame.leave_failure(line)  # as the train command does, before its connections close
    report.put((scenario.name, rank, line))
    report.close()
    report.join_thread()  # the line is written before the process goes
    os._exit(0)  # at once, as a failing rank does: its connections close, its peers notice


def _lines() -> dict[str, dict[int, str]]:
    """For each scenario, each reporting rank's error line."""
    context = mp.get_context("fork")
    report = context.Queue()
    ports = [free_port() for _ in SCENARIOS]
    processes = [
        context.Process(target=_rank, args=(rank, port, scenario, report))
        for scenario, port in zip(SCENARIOS, ports, strict=True)
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    # The agents' stores start after the fork (a forked child must not inherit a store's threads); the
    # ranks wait for them as they wait for torchrun's.
    stores = [  # noqa: F841 - held until the ranks are done
        TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        for scenario, port in zip(SCENARIOS, ports, strict=True)
        if scenario.agent_store
    ]
    lines: dict[str, dict[int, str]] = {scenario.name: {} for scenario in SCENARIOS}
    for _ in range(sum(len(scenario.reporters()) for scenario in SCENARIOS)):
        name, rank, line = report.get(timeout=240)
        lines[name][rank] = line
    for process in processes:
        process.join(30)
    return lines


@pytest.fixture(scope="module")
def lines() -> dict[str, dict[int, str]]:
    return _lines()


def _blamed(line: str) -> set[int]:
    named = re.findall(r"rank (\d+) most likely died|rank (\d+) failed first", line)
    return {int(a or b) for a, b in named}


def test_every_survivor_names_the_rank_that_died_first(lines):
    for scenario in SCENARIOS[:WORLD]:
        by_rank = lines[scenario.name]
        assert sorted(by_rank) == scenario.reporters(), (scenario.name, by_rank)
        for rank, line in by_rank.items():
            assert line.startswith(f"rank {rank}"), (scenario.name, line)
            assert _blamed(line) == {scenario.culprit}, (scenario.name, line)


def test_a_ranks_own_error_is_named_on_every_rank(lines):
    by_rank = lines["rank 3's loss function returns a tensor per sample"]
    assert "the loss function returned a tensor of shape (2, 8)" in by_rank[3]
    for rank in (0, 1, 2):
        assert _blamed(by_rank[rank]) == {3}, by_rank[rank]
        assert "rank 3 failed first: F0 (virtual stage 3) failed: the loss function returned" in by_rank[rank]


def test_where_the_store_died_too_a_survivor_names_no_rank_as_dead_and_says_it_cannot_know(lines):
    for line in lines["rank 0 killed, and the store with it"].values():
        if "lost the connection" in line:
            assert "which rank failed first is not known here" in line, line
            assert _blamed(line) <= {0}, line


def test_a_survivor_that_lost_rank_0_where_the_store_lived_asks_no_store_and_says_it_cannot_know(monkeypatch):
    """Without torchrun's agent to hold it (a store per attempt, or no torchrun), the store lives in rank 0
    and ends with it. A client that finds it gone, or still closing, retries for its whole timeout and
    prints C++ warnings and stack frames meanwhile: the survivor does not dial it at all."""
    from pipeclock import comm_blame

    with socket.socket() as listener:  # where rank 0's store was: a connection to it would show here
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(listener.getsockname()[1]))
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        comm_blame.start_group()
        comm_blame.leave_lost([0], closed=True)
        assert comm_blame.first_failure([0], closed=True) is None
        assert comm_blame.store_lost()
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody called
        comm_blame.start_group()


def test_a_store_that_refuses_the_client_after_the_first_knock_prints_no_cpp_lines(monkeypatch, capfd):
    """A store whose rank is dying may still take a plain connection, then refuse the store's client,
    which retries and logs each try in C++ (``[W ... TCPStore.cpp]``, ``Exception raised from``, frames):
    none of that reaches the user, whose one line comes after."""
    import datetime

    from pipeclock import comm_blame

    monkeypatch.setattr(comm_blame, "_STORE_TIMEOUT", datetime.timedelta(seconds=1))
    monkeypatch.setattr(comm_blame, "_MARGIN", 60.0)  # the client's retries all end within the wait
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def take_one_then_close() -> None:
        listener.accept()[0].close()
        listener.close()

    closing = threading.Thread(target=take_one_then_close)
    closing.start()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(listener.getsockname()[1]))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # an agent's store: asked, rank 0 or not
    capfd.readouterr()
    comm_blame.start_group()
    assert comm_blame.first_failure([0], closed=True) is None
    assert comm_blame.store_lost()
    closing.join()
    assert capfd.readouterr().err == ""
    comm_blame.start_group()


def test_a_store_that_takes_the_connection_and_never_answers_holds_a_survivor_a_few_seconds_at_most(
    monkeypatch,
):
    """A store that lived in a dying rank can still accept a connection, then answer nothing: a TCPStore
    client then waits past its timeout, and torchrun, which stopped the survivor with SIGTERM, kills it
    30 s later, its one line unsaid. The notes are best effort: the survivor gives them up in time."""
    import datetime
    import time

    from pipeclock import comm_blame

    monkeypatch.setattr(comm_blame, "_STORE_TIMEOUT", datetime.timedelta(seconds=1))  # the test's own wait
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections are taken (the kernel's backlog) and never answered
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(silent.getsockname()[1]))
        comm_blame.start_group()
        began = time.monotonic()
        assert comm_blame.first_failure([1], closed=True) is None
        assert comm_blame.store_lost()
        assert time.monotonic() - began < 20, "well within the 30 s torchrun gives a rank it stopped"
        comm_blame.start_group()
    for thread in threading.enumerate():  # its client fails now the listener closed: here, not after the test
        if thread.name == "pipeclock-blame-store":
            thread.join(30)


def test_a_survivor_that_cannot_know_who_failed_first_points_to_each_lost_peers_log():
    from pipeclock.comm_errors import described

    gone = RuntimeError("Connection closed by peer")
    one = described(gone, "saving", 1, [0], 30.0, store_known=False)
    several = described(gone, "saving", 1, [0, 2, 3], 30.0, store_known=False)
    unknown = "which rank failed first is not known here"
    assert str(one).endswith(f"rank 0 stopped or died (see its log; {unknown})")
    assert "ranks 0, 2 and 3 stopped or died (see their logs;" in str(several)
