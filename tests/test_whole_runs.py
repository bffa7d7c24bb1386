"""Every schedule runs the main job to its last line, on every layout, with one process's losses.

``python -m pipeclock train`` with each schedule, on the GPT and on a Hugging Face Llama (grouped-query
attention, rotary positions), at pp 2 and at pp 2 x tp 2: the run trains its steps, validates after the
last one, saves its checkpoint, prints its summary and ends on ``final loss``; every step's loss and the
validation's equal the one-process run's (rel 1e-5). The steps of each schedule and layout are held to
one process's gradients elsewhere (tests/test_pipeline_matrix.py, tests/test_tensor_parallel.py); what
is held here is what runs around them: the validation (a forward-only program of its own), the
checkpoint, the summary. A V with replicas (dp 2 x pp 2, FSDP2 and DDP), whose rank 0 holds two copies
of the GPT's tied weight, saves and resumes: the resumed step is one process's.

Each layout is one launch: its ranks run the command once per (model, schedule), each run in a process
group of its own, as torchrun would start them one after the other.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tempfile
import time
from pathlib import Path

import pytest

from pipeclock.engine.generators import SCHEDULES, V_SCHEDULES
from tests.distributed import Printed, command, free_port, start_ranks

TOLERANCE = 1e-5
STEPS = 2
COMMON = ["--seq-len", "16", "--batch-size", "8", "--microbatches", "4", "--steps", str(STEPS),
          "--eval-batches", "2", "--eval-every", "0", "--lr", "0.01", "--timeout", "30"]  # fmt: skip
GPT = ["--model", "gpt", "--dim", "16", "--layers", "4", "--heads", "2"]
LAYOUTS = {"pp 2": (2, []), "pp 2 x tp 2": (4, ["--tp", "2"])}


def each_run(rank: int, world: int, runs: list[list[str]], ended: str) -> list[Printed]:
    """``python -m pipeclock ARGV`` for each of ``runs`` in turn. The command leaves its process group at
    its end, so each run after the first joins a new one, whose store rank 0 hosts. Rank 0 ends a run
    last (it prints the summary); it then picks the next run's port and writes it to a file in ``ended``,
    and the others start the next run once they read it: no rank waits for a store not yet there, and a
    port is taken just before its use (other processes on the machine pick ports too)."""
    said = []
    for index, argv in enumerate(runs):
        if index:
            os.environ["MASTER_PORT"] = _next_port(rank, Path(ended, str(index)))
        try:
            said.append(command(rank, world, argv))
        finally:  # a rank 0 that raised still lets the others go on, to find no store and say so
            if rank == 0 and index + 1 < len(runs):
                announced = Path(ended, f"{index + 1}.partial")
                announced.write_text(str(free_port()))
                announced.rename(Path(ended, str(index + 1)))
    return said


def _next_port(rank: int, announced: Path) -> str:
    """The port rank 0 announced for the next run (the wait is bounded by the launch's deadline)."""
    while not announced.exists():
        time.sleep(0.05)
    return announced.read_text()


def launch(world: int, runs: list[list[str]]) -> list[str]:
    """Rank 0's output of each run, after asserting that every rank ended each run with exit code 0."""
    with tempfile.TemporaryDirectory() as ended:
        per_rank = start_ranks(each_run, world, runs, ended, deadline=540).values()
    for index, argv in enumerate(runs):
        ends = [said[index] for said in per_rank]
        assert all(end.code == 0 for end in ends), (" ".join(argv), [(end.code, end.err) for end in ends])
    return [end.out for end in per_rank[0]]


def models(root: Path) -> dict[str, list[str]]:
    """Each model's flags; the Llama (where transformers is installed) has its config written under
    ``root``: a config alone, its weights made from (seed, parameter name)."""
    if importlib.util.find_spec("transformers") is None:
        return {"gpt": GPT}
    from tests.hf_cases import llama_config

    llama = root / "llama.json"
    llama_config(layers=4).to_json_file(str(llama))
    return {"gpt": GPT, "llama": ["--model", "hf", "--hf-config", str(llama)]}


def argv(root: Path, name: str, flags: list[str], extra: list[str]) -> list[str]:
    """The run's command line; its losses and checkpoint go under ``root / name``."""
    out = root / name
    return ["train", *flags, *COMMON, *extra, "--losses", str(out / "losses.json"),
            "--checkpoint-dir", str(out / "ckpt")]  # fmt: skip


def with_steps(command_line: list[str], steps: int) -> list[str]:
    at = command_line.index("--steps")
    return [*command_line[: at + 1], str(steps), *command_line[at + 2 :]]


def losses(root: Path, name: str) -> tuple[list[float], list[list[float]]]:
    saved = json.loads((root / name / "losses.json").read_text())
    return saved["losses"], saved["validation"]


def gap(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Where every run writes, with the one-process runs of both models done (one launch)."""
    root = tmp_path_factory.mktemp("whole_runs")
    runs = [argv(root, f"one {model}", flags, []) for model, flags in models(root).items()]
    launch(1, [*runs, with_steps(argv(root, "one gpt longer", GPT, []), STEPS + 1)])
    return root


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_schedule_runs_train_to_its_last_line_with_one_process_losses(root, layout):
    world, extra = LAYOUTS[layout]
    runs = {
        (model, schedule): argv(root, f"{layout} {model} {schedule}", flags, ["--schedule", schedule, *extra])
        for model, flags in models(root).items()
        for schedule in SCHEDULES
    }
    said = dict(zip(runs, launch(world, list(runs.values())), strict=True))
    for (model, schedule), out in said.items():
        name = f"{layout} {model} {schedule}"
        lines = out.splitlines()
        assert lines[0].startswith(f"pipeclock train: {schedule},"), (name, lines[0])
        assert re.search(rf"^  after +{STEPS} steps +[\d.]+ nats/token", out, re.M), (name, out)
        assert "step time" in out and "bubble" in out, (name, out)  # the summary
        assert re.fullmatch(rf"final loss [\d.]+ after {STEPS} steps", lines[-1]), (name, lines[-1])
        assert any((root / name / "ckpt").iterdir()), name
        want_steps, want_validation = losses(root, f"one {model}")
        got_steps, got_validation = losses(root, name)
        assert gap(got_steps, want_steps) <= TOLERANCE, (name, got_steps, want_steps)
        assert [steps for steps, _ in got_validation] == [steps for steps, _ in want_validation] == [STEPS]
        validation = [loss for _, loss in got_validation]
        assert gap(validation, [loss for _, loss in want_validation]) <= TOLERANCE, (name, validation)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_v_with_replicas_saves_its_tied_weight_once_and_resumes_with_one_process_losses(root):
    """A V holds the GPT's embedding and its tied head on one rank; with replicas each chunk owns a copy.
    Saved, the weight is named once; resumed, both copies take it: the next step is one process's."""
    cases = [(engine, schedule) for engine in ("fsdp", "ddp") for schedule in V_SCHEDULES]
    runs = []
    for engine, schedule in cases:
        flags = ["--schedule", schedule, "--dp", "2", "--data-parallel", engine]
        saved = root / f"dp {engine} {schedule}"
        runs.append(argv(root, saved.name, GPT, flags))
        then = argv(root, f"resumed {engine} {schedule}", GPT, [*flags, "--resume", str(saved / "ckpt")])
        runs.append(with_steps(then, STEPS + 1))
    launch(4, runs)
    want, _ = losses(root, "one gpt longer")
    _, want_validation = losses(root, "one gpt")
    for engine, schedule in cases:
        got, validation = losses(root, f"dp {engine} {schedule}")
        assert gap(got, want[:STEPS]) <= TOLERANCE, (engine, schedule, got, want)
        assert gap([v for _, v in validation], [v for _, v in want_validation]) <= TOLERANCE, validation
        resumed = json.loads((root / f"resumed {engine} {schedule}" / "losses.json").read_text())
        assert resumed["first_step"] == STEPS, (engine, schedule, resumed)
        assert gap(resumed["losses"], want[STEPS:]) <= TOLERANCE, (engine, schedule, resumed, want)
