"""The main job on a (dp, pp) mesh: the same run on any layout, across two torchrun agents, clipped,
resumed on another layout, and restarted after a rank dies.

Every job trains the same small GPT for ten steps (dropout and the tied embedding included); each must
follow the one-process Adam run with ``clip_grad_norm_`` to float tolerance. The jobs that need torchrun
(its restart after a death, its rendezvous of two agents) run under it; the others run the train command
on gloo processes from ``tests.distributed``, which start faster. The four-replica run and the two agents
run with the long tests.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.engine import rng
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.models.gpt import GPTConfig, gpt_sequential
from pipeclock.models.text import TextCorpus
from tests.distributed import Started, command, free_port, printed, start_ranks
from tests.jobs import LAUNCH_TIMEOUT, Launch, losses_of

GPT = dict(model="gpt", dim=32, layers=4, heads=2, seq_len=32, batch_size=9, microbatches=2, dropout=0.1)
STEPS, CLIP, LR = 10, 0.5, 3e-3


def flags(**options) -> list[str]:
    found = []
    for name, value in {**GPT, "steps": STEPS, "clip_grad_norm": CLIP, "eval_batches": 1, **options}.items():
        flag = "--" + name.replace("_", "-")
        if value is not None:
            found += [flag] if value is True else [flag, str(value)]
    return ["train", *found]


def one_process_run() -> tuple[list[float], list[float]]:
    """The reference: the whole GPT, one process, the whole batch; its losses and unclipped norms."""
    config = GPTConfig(dim=32, layers=4, heads=2, seq_len=32, dropout=0.1, seed=0)
    model, corpus, loss_fn = gpt_sequential(config), TextCorpus.default(), TokenCrossEntropy()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        ids, targets = corpus.batch(step, GPT["batch_size"], config.seq_len, seed=0)
        optimizer.zero_grad()
        with rng.keyed(step, 0):
            loss = loss_fn.mean(model(ids), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


@dataclass
class Runs:
    tmp: Path
    logs: dict[str, str]

    def losses(self, name: str) -> tuple[int, list[float]]:
        return losses_of(self.tmp / f"{name}.json")

    def printed_losses(self, name: str) -> list[float]:
        """Every step's loss as the job printed it (the latest attempt's, for a restarted step)."""
        printed = re.findall(r"^step\s+(\d+)\s+loss ([\d.]+)$", self.logs[name], re.M)
        return [float(loss) for _, loss in sorted({int(step): loss for step, loss in printed}.items())]


def _log(job: Launch | Started) -> str:
    """A job's standard output (rank 0 speaks for the run), after asserting that it succeeded."""
    return job.result() if isinstance(job, Launch) else printed(job)


class Jobs:
    """Starts the jobs of one fixture in one folder and stops whatever is left of them at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.started = tmp, []

    def job(self, name: str, processes: int, directory: str | None = None, **options) -> Launch | Started:
        """A torchrun job when it restarts or joins other agents; else the command on gloo processes."""
        options.setdefault("losses", self.tmp / f"{name}.json")
        options.setdefault("checkpoint_dir", self.tmp / (directory or name))
        restarts = options.pop("restarts", 0)
        module = options.pop("module", "pipeclock")
        rendezvous = options.pop("rendezvous", None)
        argv = flags(**options)
        if module != "pipeclock":
            argv = ["7", *argv]  # tests.dying_train kills local rank 1 after step 7 (once)
        if restarts or rendezvous or module != "pipeclock":
            launch = Launch(
                self.tmp / name, processes, argv, restarts=restarts, module=module, rendezvous=rendezvous
            )
            self.started.append(launch)
        else:
            self.started.append(start_ranks(command, processes, argv, deadline=LAUNCH_TIMEOUT))
        return self.started[-1]

    def agent(self, node: int, endpoint: str) -> Launch:
        rendezvous = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        # one checkpoint directory for both, as machines that share a file system would have
        rendezvous += ["--rdzv-id", "two"]
        return self.job(
            f"node{node}", 1, "nodes", dp=2, losses=self.tmp / "nodes.json", rendezvous=rendezvous
        )

    def stop(self) -> None:
        for launch in self.started:
            launch.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[Runs]:
    """dp 2 x pp 2 dying once and restarted, then its step-5 checkpoint resumed on another mesh."""
    jobs = Jobs(tmp_path_factory.mktemp("mesh"))
    try:
        # dp 2 x pp 2 loses a rank after step 7; torchrun restarts it and it resumes from step 5
        dying = dict(checkpoint_every=5, resume=True, restarts=1, module="tests.dying_train")
        logs = {"dp2pp2": _log(jobs.job("dp2pp2", 4, dp=2, **dying))}
        # its step-5 checkpoint, two stages x two replicas, resumes on four stages and no replicas
        shutil.copytree(jobs.tmp / "dp2pp2", jobs.tmp / "to_dp1pp4")
        shutil.rmtree(jobs.tmp / "to_dp1pp4" / "step_000010")
        logs["to_dp1pp4"] = _log(jobs.job("to_dp1pp4", 4, dp=1, resume=True))
        yield Runs(jobs.tmp, logs)
    finally:
        jobs.stop()


@pytest.fixture(scope="module")
def wide_runs(tmp_path_factory) -> Iterator[Runs]:
    """Four replicas under DDP, and two torchrun agents joined by a c10d rendezvous (the long tests')."""
    jobs = Jobs(tmp_path_factory.mktemp("wide"))
    try:
        endpoint = f"127.0.0.1:{free_port()}"
        first = {
            "dp4": jobs.job("dp4", 4, dp=4, data_parallel="ddp"),
            "node0": jobs.agent(0, endpoint),
            "node1": jobs.agent(1, endpoint),
        }
        yield Runs(jobs.tmp, {name: _log(launch) for name, launch in first.items()})
    finally:
        jobs.stop()


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float]]:
    return one_process_run()


def test_the_reference_run_really_clips(reference):
    losses, norms = reference
    assert sum(norm > CLIP for norm in norms) >= STEPS // 2, norms
    assert losses[-1] < losses[0] - 0.5, "the GPT learns"


@pytest.mark.long
@pytest.mark.parametrize("name", ["dp4", "nodes"])
def test_ten_clipped_steps_on_any_mesh_and_across_two_agents_follow_one_process(wide_runs, reference, name):
    first, losses = wide_runs.losses(name)
    assert first == 0 and losses == pytest.approx(reference[0], rel=1e-5)


@pytest.mark.slow
def test_ten_clipped_steps_on_dp2_pp2_follow_one_process_across_a_restart(runs, reference):
    assert runs.printed_losses("dp2pp2") == pytest.approx(reference[0], rel=1e-5)  # printed to 6 digits


@pytest.mark.long
def test_two_agents_joined_by_c10d_rendezvous_report_their_nodes_and_dp_time(wide_runs):
    log = wide_runs.logs["node0"] + wide_runs.logs["node1"]
    assert "2 replicas (fsdp)" in log
    assert re.search(r"^nodes\s+1: \S+: ranks 0, 1$", log, re.M), log
    assert re.search(r"dp gradient sums \d+\.\d%", log), log


@pytest.mark.slow
def test_a_checkpoint_of_dp2_pp2_resumes_on_another_mesh_on_the_same_curve(runs, reference):
    first, losses = runs.losses("to_dp1pp4")
    assert first == 5 and losses == pytest.approx(reference[0][5:], rel=1e-5)
    assert "saved by 2 stage(s) x 2 replicas" in runs.logs["to_dp1pp4"]


@pytest.mark.slow
def test_a_rank_killed_in_a_2d_run_is_restarted_and_resumes_from_the_checkpoint(runs, reference):
    log = runs.logs["dp2pp2"]
    assert "to resume from: starting fresh" in log  # the first attempt
    assert len(re.findall(r"^resumed from .*step_000005 at step 5 ", log, re.M)) == 1  # the second
    first, losses = runs.losses("dp2pp2")
    assert first == 5 and losses == pytest.approx(reference[0][5:], rel=1e-5)


@pytest.mark.slow
def test_a_2d_checkpoint_holds_the_whole_model_trained_on_any_mesh(runs):
    sharded, run = checkpoint.load_full_model(runs.tmp / "dp2pp2" / "step_000010")
    staged, other = checkpoint.load_full_model(runs.tmp / "to_dp1pp4" / "step_000010")
    assert (run["stages"], run["replicas"], other["stages"], other["replicas"]) == (2, 2, 4, 1)
    assert sharded.keys() == staged.keys()
    assert all(torch.allclose(sharded[key], staged[key], atol=1e-5) for key in sharded)
