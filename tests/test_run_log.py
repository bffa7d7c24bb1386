"""A run's figures where a team watches them: ``metrics.jsonl`` and TensorBoard hold the run's own losses.

One launch of ``train`` on 2 processes (2 stages) with ``--log-dir`` gives the records the files are
compared with: its ``--losses`` and validation lines. The same run again from the ``config.toml`` it
wrote gives the same losses, and refused runs leave what was saved as it was. The log's arithmetic, the
refusals of missing packages and the progress bar are checked in this process.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeclock.cli import dispatch
from pipeclock.observe.run_log import METRICS_NAME, RunLog
from pipeclock.plan.gpus import GIB, KINDS
from pipeclock.plan.hf_paper import paper_model, read_config
from pipeclock.plan.paper_model import gpt_model
from pipeclock.plan.run_flops import flops_per_token, gpu_kind
from pipeclock.training.loop import TrainConfig
from pipeclock.training.progress import Progress
from tests.distributed import command, start_ranks

CONFIGS = Path(__file__).resolve().parents[1] / "docs" / "configs"
STEPS, BATCH, SEQ = 6, 4, 16
GPT = (
    f"--model gpt --layers 2 --dim 32 --heads 2 --seq-len {SEQ} --batch-size {BATCH} --steps {STEPS} "
    "--microbatches 2 --eval-every 3 --eval-batches 1 --log-every 2 --clip-grad-norm 0.5 --lr 0.01"
).split()


def events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = EventAccumulator(str(folder))
    found.Reload()
    return found


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / METRICS_NAME).read_text().splitlines()]


def launch(argv: list[str], world: int = 2):
    """``pipeclock train ARGV`` on ``world`` forked ranks: each rank's exit code, stdout and stderr."""
    return start_ranks(command, world, ["train", *argv]).values()


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """The run the files are checked against: its folder and each rank's exit code and output."""
    tmp = tmp_path_factory.mktemp("run-log")
    text = tmp / "text.txt"
    text.write_text(Path(argparse.__file__).read_text()[:30000])
    a = [*GPT, "--data", str(text), "--log-dir", str(tmp / "A"), "--checkpoint-dir", str(tmp / "ckA")]
    ranks = launch([*a, "--losses", str(tmp / "A.json")])
    assert [rank.code for rank in ranks] == [0, 0], [rank.err for rank in ranks]
    return tmp, ranks


@pytest.fixture(scope="module")
def after_a(run_a):
    """Run B from A's resolved config.toml; then two runs refused, one by A's checkpoints and one by A's
    log, with a copy of what A saved taken before them."""
    tmp = run_a[0]
    config = ["--config", str(tmp / "A" / "config.toml")]
    b = [*config, "--log-dir", str(tmp / "B"), "--checkpoint-dir", str(tmp / "ckB")]
    ran_b = launch([*b, "--losses", str(tmp / "B.json")])
    saved = {p: p.read_bytes() for p in [*sorted((tmp / "A").iterdir()), tmp / "ckA" / "config.toml"]}
    refused = [
        launch([*config, "--log-dir", str(tmp / "C")], world=1),  # into ckA, which holds A's checkpoints
        launch([*config, "--checkpoint-dir", str(tmp / "D")]),  # into A's log, on both of its ranks
    ]
    return ran_b, saved, refused


def test_rank_0_alone_writes_the_logs(run_a):
    names = sorted(p.name for p in (run_a[0] / "A").iterdir())
    assert len(names) == 3 and names[1].startswith("events.out.tfevents.")  # one event file, one writer
    assert [names[0], names[2]] == ["config.toml", METRICS_NAME]


def test_metrics_hold_the_runs_losses_every_n_steps_the_last_and_each_validation(run_a):
    tmp, ranks = run_a
    losses = json.loads((tmp / "A.json").read_text())["losses"]
    found = records(tmp / "A")
    assert [r["step"] for r in found] == [2, 3, 4, 6]  # --log-every 2; validation after 3 and 6
    assert [r["loss"] for r in found] == [losses[r["step"] - 1] for r in found]
    assert [r["step"] for r in found if "val_loss" in r] == [3, 6]
    printed = [line.split() for line in ranks[0].out.splitlines() if line.startswith("validation after")]
    assert [f"{r['val_loss']:.4f}" for r in found if "val_loss" in r] == [words[4] for words in printed]


def test_each_record_has_the_rate_tokens_time_gradient_norm_and_memory(run_a):
    found = records(run_a[0] / "A")
    assert all(r["lr"] == 0.01 for r in found)
    assert [r["tokens"] for r in found] == [r["step"] * BATCH * SEQ for r in found]  # cumulative
    for r in found:
        assert r["grad_norm"] > 0 and r["step_seconds"] > 0 and r["rss_mib"] > 100
        assert r["tokens_per_second"] == pytest.approx(BATCH * SEQ / r["step_seconds"], rel=1e-9)
        assert "mfu" not in r and "tflops_per_gpu" not in r  # on a GPU only


def test_tensorboard_shows_the_same_figures_at_the_same_steps(run_a):
    folder = run_a[0] / "A"
    found, shown = records(folder), events(folder)
    for tag, name in (("train/loss", "loss"), ("val/loss", "val_loss"), ("train/tokens", "tokens")):
        expected = [(r["step"], np.float32(r[name])) for r in found if name in r]
        assert [(p.step, np.float32(p.value)) for p in shown.Scalars(tag)] == expected, tag


def test_the_resolved_config_is_beside_the_checkpoints_and_in_the_log(run_a):
    tmp = run_a[0]
    written = (tmp / "A" / "config.toml").read_text()
    assert (tmp / "ckA" / "config.toml").read_text() == written
    assert f'log-dir = "{tmp}/A"\n' in written and "steps = 6\n" in written and "lr = 0.01\n" in written


def test_the_resolved_config_runs_the_same_run_again(run_a, after_a):
    tmp, ran_b = run_a[0], after_a[0]
    assert [rank.code for rank in ran_b] == [0, 0], [rank.err for rank in ran_b]
    first, again = (json.loads((tmp / name).read_text()) for name in ("A.json", "B.json"))
    assert again == first
    changed = {"log-dir", "checkpoint-dir", "losses"}
    a, b = ((tmp / run / "config.toml").read_text().splitlines() for run in ("A", "B"))
    assert [line for line in a if line.split(" = ")[0] not in changed] == [
        line for line in b if line.split(" = ")[0] not in changed
    ]


def test_a_refused_run_changes_nothing_already_saved(run_a, after_a):
    tmp, (_, saved, refused) = run_a[0], after_a
    (by_checkpoints,), by_log = refused
    assert by_checkpoints.code == 2 and "already holds checkpoints" in by_checkpoints.err
    for rank, printed in enumerate(by_log):  # every rank reaches the refusal, and each names itself
        assert printed.code == 2 and printed.err.strip().endswith(
            f"pipeclock train: error: rank {rank}: --log-dir {tmp}/A already holds a run's metrics.jsonl; "
            "resume that run (--resume), or choose another folder"
        ), printed.err
    assert {p: p.read_bytes() for p in saved} == saved
    assert not (tmp / "C" / METRICS_NAME).exists() and not (tmp / "D" / "config.toml").exists()


# --- in this process: the log's arithmetic and its refusals -------------------------------------------------


def figures(loss: float, seconds: float, tokens: int = 100, **more) -> dict:
    return {"loss": loss, "lr": 0.1, "step_seconds": seconds, "step_tokens": tokens, **more}


def test_a_record_averages_the_steps_since_the_last_one(tmp_path):
    log = RunLog(str(tmp_path), every=3, last_step=7, flops_per_token=6e9, peak_flops=1e15, processes=4)
    written = [log.log(step, figures(step / 10, seconds=step / 100)) for step in range(1, 8)]
    log.close()
    assert [r["step"] for r in written if r] == [3, 6, 7]
    third, sixth, last = (r for r in written if r)
    assert sixth["tokens"] == 600 and last["tokens"] == 700
    assert sixth["step_seconds"] == pytest.approx((0.04 + 0.05 + 0.06) / 3)
    assert sixth["tokens_per_second"] == pytest.approx(300 / 0.15)
    assert sixth["tflops_per_gpu"] == pytest.approx(300 / 0.15 * 6e9 / 4 / 1e12)
    assert sixth["mfu"] == pytest.approx(300 / 0.15 * 6e9 / 4 / 1e15)
    assert records(tmp_path) == [third, sixth, last]


def test_a_validation_loss_is_recorded_at_its_step_whatever_log_every_says(tmp_path):
    log = RunLog(str(tmp_path), every=10, last_step=20)
    written = [log.log(step, figures(1.0, 0.1, val_loss=2.0 if step == 4 else None)) for step in (1, 2, 3, 4)]
    log.close()
    assert [r and r["step"] for r in written] == [None, None, None, 4]
    assert written[3]["val_loss"] == 2.0 and "grad_norm" not in written[3]


def test_a_resumed_log_drops_the_records_of_steps_it_does_again(tmp_path):
    first = RunLog(str(tmp_path), every=1, last_step=6)
    for step in range(1, 6):  # the run died after step 5; its last checkpoint is at step 3
        first.log(step, figures(float(step), 0.1))
    first.close()
    resumed = RunLog(str(tmp_path), every=1, last_step=6, start=3)
    for step in range(4, 7):
        resumed.log(step, figures(10.0 + step, 0.1))
    resumed.close()
    assert [(r["step"], r["loss"], r["tokens"]) for r in records(tmp_path)] == [
        (1, 1.0, 100), (2, 2.0, 200), (3, 3.0, 300), (4, 14.0, 400), (5, 15.0, 500), (6, 16.0, 600)
    ]  # fmt: skip
    shown = events(tmp_path).Scalars("train/loss")
    assert [(p.step, p.value) for p in shown] == [(1, 1), (2, 2), (3, 3), (4, 14), (5, 15), (6, 16)]


def refusal(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        code = dispatch.main(["train", *argv])
    return code, err.getvalue()


def test_wandb_without_its_package_is_refused_in_one_line_before_anything_is_written(tmp_path):
    assert "wandb" not in sys.modules
    code, err = refusal(["--wandb", "team-runs", "--log-dir", str(tmp_path / "logs"), "--steps", "1"])
    assert (code, err) == (
        2,
        "pipeclock train: error: --wandb team-runs: the wandb package is not installed: pip install wandb "
        "(WANDB_MODE=offline then logs with no network)\n",
    )
    assert not (tmp_path / "logs").exists()


def test_a_log_dir_without_tensorboard_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    code, err = refusal(["--log-dir", str(tmp_path / "logs"), "--steps", "1"])
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(
        f"pipeclock train: error: --log-dir {tmp_path}/logs: TensorBoard's event files need"
    )


@pytest.mark.parametrize(
    "argv, says",
    [(["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
     (["--log-dir", "/proc/pipeclock-logs"], "--log-dir /proc/pipeclock-logs: cannot write in /proc")],
)  # fmt: skip
def test_bad_log_flags_are_one_line_and_exit_2(argv, says):
    code, err = refusal(argv)
    assert code == 2 and len(err.splitlines()) == 1 and says in err


@pytest.mark.parametrize(
    "name, memory_gb, kind",
    [("NVIDIA H200", 141, "H200"), ("NVIDIA H100 80GB HBM3", 80, "H100-80GB"),
     ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"), ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),
     ("NVIDIA GeForce RTX 4090", 24, "RTX4090"), ("NVIDIA L40S", 48, "L40S"),
     ("AMD Instinct MI300X", 192, "MI300X"), ("NVIDIA H100 NVL", 94, None), ("Tesla T4", 16, None)],
)  # fmt: skip
def test_the_gpu_table_gives_the_peak_of_the_gpu_torch_names(name, memory_gb, kind):
    found = gpu_kind(name, memory_gb * GIB)
    assert found is (KINDS[kind] if kind else None)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_rank_0_shows_a_bar_with_the_loss_tokens_per_second_and_time_left():
    shown = Terminal()
    progress = Progress(4, enabled=True, step_tokens=2048, stream=shown)
    progress.begin(0)
    for step in range(4):
        progress(step, 2.5 - step / 10)
    progress.close()
    last = shown.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "4/4" in last and "loss=2.2000" in last and "tok/s=" in last and "<00:00" in last


def test_elsewhere_it_prints_plain_lines(capsys):
    progress = Progress(20, enabled=True, stream=io.StringIO())
    for step in range(20):
        progress(step, 1.0)
    assert capsys.readouterr().out.splitlines()[:2] == [
        "step     0  loss 1.000000",
        "step     2  loss 1.000000",
    ]


def test_the_flops_a_token_costs_are_the_planners_paper_models():
    mlp = TrainConfig(model="mlp", hidden=32, layers=3)
    assert flops_per_token(mlp, None) == 6 * 3 * 32 * 32  # a sample is one token
    gpt = TrainConfig(model="gpt", dim=64, layers=2, heads=4, seq_len=16)
    task = SimpleNamespace(gpt=SimpleNamespace(vocab_size=256))
    assert flops_per_token(gpt, task) == gpt_model(64, 2, 4, 256).model_flops_per_token(16)
    llama = TrainConfig(model="hf", hf_config=str(CONFIGS / "llama-tiny.json"), seq_len=64)
    config = read_config(CONFIGS / "llama-tiny.json")
    found = flops_per_token(llama, SimpleNamespace(hf_config=config))
    assert found == paper_model(config).model_flops_per_token(64) > 6 * 4 * 128 * 128
