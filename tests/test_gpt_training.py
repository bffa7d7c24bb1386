"""The main job with ``--model gpt``: the one-process loss curve on real text, checkpoints, export,
generation, and one clear error for each bad input."""

from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from pipeclock import cli
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.engine import rng
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.models.gpt import GPTConfig, gpt_sequential
from pipeclock.models.text import TextCorpus
from pipeclock.training.loop import TrainConfig, train
from tests.distributed import run_ok

SMALL = dict(model="gpt", dim=32, layers=4, heads=2, seq_len=32, batch_size=7, microbatches=3, dropout=0.1)


def twenty_gpt_steps(rank: int, p: int, directory: str) -> list[float]:
    config = TrainConfig(**SMALL, steps=20, eval_every=10, checkpoint_dir=directory)
    result = train(config)
    return [result.losses, result.validation]


def one_process_curve(steps: int = 20) -> list[float]:
    config = TrainConfig(**SMALL, steps=steps)
    gpt = GPTConfig(dim=32, layers=4, heads=2, seq_len=32, dropout=0.1, seed=0)
    model, corpus, loss_fn = gpt_sequential(gpt), TextCorpus.default(), TokenCrossEntropy()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    losses = []
    for step in range(steps):
        ids, targets = corpus.batch(step, config.batch_size, config.seq_len, seed=0)
        optimizer.zero_grad()
        with rng.keyed(step, 0):
            loss = loss_fn.mean(model(ids), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def three_stage_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt") / "ckpt"
    per_rank = run_ok(twenty_gpt_steps, 3, str(directory), deadline=300)
    return per_rank, directory


def test_twenty_steps_on_three_stages_follow_the_one_process_loss_curve(three_stage_run):
    per_rank, _ = three_stage_run
    (losses, validation), expected = per_rank[0], one_process_curve()
    assert expected[-1] < expected[0] - 1.0, "the GPT really learns"
    assert all(rank_losses == losses for rank_losses, _ in per_rank), "every rank reports the same loss"
    gaps = [abs(a - b) / b for a, b in zip(losses, expected, strict=True)]
    assert max(gaps) <= 1e-5, max(gaps)
    assert [steps for steps, _ in validation] == [10, 20] and validation[1][1] < validation[0][1]


def test_a_gpt_checkpoint_exports_and_generates_on_one_process(three_stage_run, tmp_path):
    _, directory = three_stage_run
    newest = checkpoint_choice.newest(directory)
    saved = checkpoint_choice.read_run(newest)
    assert saved["model"] == "GPT" and saved["stages"] == 3 and saved["gpt"]["layers"] == 4
    model, _ = checkpoint.load_model(newest)
    assert torch.equal(model.embed.wte.weight, model.head.lm_head.weight), "the tie is one tensor"
    exported, stdout = tmp_path / "gpt.pt", io.StringIO()
    with redirect_stdout(stdout):
        assert cli.main(["export", str(directory), str(exported)]) == 0
    fresh = gpt_sequential(GPTConfig(**saved["gpt"]))
    fresh.load_state_dict(torch.load(exported))
    ids = torch.arange(10)[None]
    assert torch.equal(fresh.eval()(ids), model.eval()(ids))
    assert "load it into gpt_sequential(GPTConfig(" in stdout.getvalue()
    texts = []
    for _ in range(2):
        out = io.StringIO()
        with redirect_stdout(out), redirect_stderr(io.StringIO()):
            assert cli.main(["generate", str(directory), "--prompt", "import ", "--tokens", "40"]) == 0
        texts.append(out.getvalue())
    assert texts[0] == texts[1], "the same seed gives the same text"
    assert texts[0].startswith("import ") and len(texts[0].encode()) >= len("import ") + 40


def error_of(*argv: str) -> tuple[int, str]:
    stderr = io.StringIO()
    with redirect_stderr(stderr), redirect_stdout(io.StringIO()):
        code = cli.main(list(argv))
    return code, stderr.getvalue().strip()


def test_bad_input_is_one_clear_line(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny corpus")
    cases = {
        "missing data": (["--data", str(tmp_path / "nowhere.txt")], "does not exist"),
        "corpus shorter than one sequence": (["--data", str(short)], "shorter than one sequence"),
        "dim not divisible by heads": (["--dim", "30", "--heads", "4"], "dim 30 is not divisible by heads 4"),
        "more stages than pieces": (["--layers", "1", "--chunks", "4", "--schedule", "interleaved-1f1b"],
                                    "has 3 pieces (embedding, blocks, head): it cannot be cut into 4 stages"),
    }  # fmt: skip
    for name, (flags, expected) in cases.items():
        code, message = error_of("train", "--model", "gpt", "--steps", "1", *flags)
        assert code == 2 and expected in message and message.count("\n") == 0, (name, message)
        assert message.startswith("pipeclock train: error: "), (name, message)
    code, message = error_of("generate", str(tmp_path), "--prompt", "x")
    assert (
        code == 2
        and message
        == f"pipeclock generate: error: no checkpoint in {tmp_path}: no complete step_NNNNNN directory in it"
    )


@pytest.mark.slow
def test_the_default_gpt_job_starts_with_two_ranks_under_torchrun(tmp_path):
    """The real launcher, two processes, a few steps of the default GPT: the last line is the contract."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "pipeclock", "train", "--model", "gpt", "--steps", "4", "--eval-every", "2",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("final loss ") and lines[-1].endswith(" after 4 steps")
    assert any("bigram byte model (order 1, fitted on the training split)" in line for line in lines)
