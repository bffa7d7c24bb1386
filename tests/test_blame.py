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

import torch
from torch import nn
from torch.distributed import TCPStore

WORLD = 4
STEPS = 3


def _rank(rank: int, port: int, victim: int, report) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0"
    )
    os.environ["PIPECLOCK_FAULT"] = f"F:{victim}:1"
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as under torchrun: the store outlives the ranks
    from pipeclock import comms, schedule
    from pipeclock.engine import faults

    comms.init(backend="gloo", timeout=60)  # far beyond a step: only a hang reaches it
    faults.arm(WORLD)
    torch.manual_seed(rank)
    pipe = schedule.Pipeline(nn.Linear(8, 8), "1f1b", 4, nn.functional.mse_loss)
    try:
        for _ in range(STEPS):
            pipe.step(torch.randn(8, 8), torch.randn(8, 8))
        report.put((victim, rank, "no error"))
    except Exception as error:  # what this survivor would print: its error's first line
        report.put((victim, rank, str(error).splitlines()[0]))
    report.close()
    report.join_thread()  # the line is written before the process goes
    os._exit(0)  # at once, as a failing rank does: its connections close, its peers notice


def _survivors_lines() -> dict[int, dict[int, str]]:
    """For each victim, each survivor's error line."""
    context = mp.get_context("fork")
    report = context.Queue()
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(WORLD)]
    processes = [
        context.Process(target=_rank, args=(rank, store.port, victim, report))
        for victim, store in enumerate(stores)
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    lines: dict[int, dict[int, str]] = {victim: {} for victim in range(WORLD)}
    for _ in range(WORLD * (WORLD - 1)):
        victim, rank, line = report.get(timeout=240)
        lines[victim][rank] = line
    for process in processes:
        process.join(30)
    return lines


def test_every_survivor_names_the_rank_that_died_first():
    found = _survivors_lines()
    for victim, by_rank in found.items():
        assert sorted(by_rank) == [rank for rank in range(WORLD) if rank != victim], (victim, by_rank)
        for rank, line in by_rank.items():
            assert line.startswith(f"rank {rank}"), (victim, line)
            named_dead = re.findall(r"rank (\d+) most likely died|rank (\d+) failed first", line)
            dead = {int(a or b) for a, b in named_dead}
            assert dead == {victim}, (victim, line)
