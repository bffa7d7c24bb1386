"""What a new user meets first: every command's help, its refusals, and how it ends when interrupted.

A bad value is one line naming the flag and exit code 2, found while the command line is read; an
output that cannot be written is found before the work; Ctrl-C is one line per rank and no traceback.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeclock.cli.arguments import DefaultsHelpFormatter, shows_default
from pipeclock.cli.commands.train import StepsSeen
from pipeclock.cli.dispatch import COMMANDS, build_parser, main
from tests.jobs import signal_group_when

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 120  # seconds: only a hung run gets near it


@pytest.fixture
def command(monkeypatch, capsys):
    """Run ``pipeclock ARGS`` in this process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["pipeclock"])

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.mark.parametrize(
    "args, complaint",
    [
        (["train", "--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["train", "--steps", "-5"], "argument --steps: must be a positive integer, got -5"),
        (["train", "--steps", "ten"], "argument --steps: must be a positive integer, got 'ten'"),
        (["train", "--microbatches", "0"], "argument --microbatches: must be a positive integer, got 0"),
        (["train", "--hidden", "0"], "argument --hidden: must be a positive integer, got 0"),
        (["train", "--layers", "0"], "argument --layers: must be a positive integer, got 0"),
        (["train", "--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
        (["train", "--dp", "0"], "argument --dp: must be a positive integer, got 0"),
        (["train", "--timeout", "0"], "argument --timeout: must be a number > 0, got 0"),
        (["train", "--timeout", "-1"], "argument --timeout: must be a number > 0, got -1"),
        (["train", "--timeout", "nan"], "argument --timeout: must be a number > 0, got nan"),
        (["train", "--lr=-0.1"], "argument --lr: must be a number > 0, got -0.1"),
        (["train", "--lr", "-1e-3"], "argument --lr: must be a number > 0, got -1e-3"),
        (["train", "--dropout", "1"], "argument --dropout: must be a number in [0, 1), got 1"),
        (["train", "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
        (
            ["train", "--checkpoint-every", "-1"],
            "argument --checkpoint-every: must be an integer >= 0, got -1",
        ),
        (
            ["schedule", "1f1b", "-p", "0", "-m", "2"],
            "argument --stages/-p: must be a positive integer, got 0",
        ),
        (
            ["schedule", "1f1b", "-p", "2", "-m", "2", "--link-latency", "-1"],
            "argument --link-latency: must be a number",
        ),
        (
            ["plan", "--params", "1e9", "--layers", "0"],
            "argument --layers: must be a positive integer, got 0",
        ),
        (["plan", "--params", "1e9", "--top", "0"], "argument --top: must be a positive integer, got 0"),
        (["lab", "0"], "argument number: must be a positive integer, got 0"),
        (["lab", "4", "--nproc", "0"], "argument --nproc: must be a positive integer, got 0"),
        (["bench", "--runs", "0"], "argument --runs: must be a positive integer, got 0"),
        (["generate", "ckpt", "--tokens", "-1"], "argument --tokens: must be an integer >= 0, got -1"),
        (
            ["generate", "ckpt", "--temperature", "-1"],
            "argument --temperature: must be a number >= 0, got -1",
        ),
    ],
)
def test_a_value_that_cannot_work_is_one_line_naming_the_flag_and_exit_2(command, args, complaint):
    code, out, err = command(*args)
    assert (code, out) == (2, "")
    assert err.startswith(f"pipeclock {args[0]}: error: {complaint}")
    assert err.count("\n") == 1


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser([name])
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_of_every_command_says_what_it_does_and_its_default(name):
    formatter = DefaultsHelpFormatter(prog=f"pipeclock {name}")
    for action in command_parser(name)._actions:
        assert action.help, f"pipeclock {name} {action.dest} has no help"
        if shows_default(action):
            text = formatter._get_help_string(action).lower()
            assert "default" in text or "required" in text, f"pipeclock {name} {action.dest}"


def test_train_help_shows_defaults_and_that_stages_are_processes(command):
    code, out, _ = command("train", "--help")
    assert code == 0
    assert "--hidden HIDDEN       the MLP's width (default: 1024)" in out
    assert "--timeout TIMEOUT     seconds any blocking call may wait (default: 60.0)" in out
    assert "torchrun --nproc-per-node P -m pipeclock train runs P stages" in " ".join(out.split())


def test_a_labs_help_is_printed_once(capfd, monkeypatch):
    """lab 4 runs on two processes; its --help needs none, and used to be printed by each."""
    monkeypatch.setattr(sys, "argv", ["pipeclock"])
    monkeypatch.chdir(ROOT)  # the command is shown relative to here
    assert main(["lab", "4", "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("$ python labs/04_naive.py --help\n")
    assert out.count("usage: 04_naive.py") == 1


def test_help_into_a_closed_pipe_ends_quietly():
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeclock", "schedule", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    process.stdout.close()  # the reader (`| head -1`) is gone before the help is written
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=DEADLINE) == 0 and stderr == ""


@pytest.mark.parametrize(
    "flag, where, complaint",
    [
        ("--png", "a_file/timeline.png", "a_file is a file, so nothing can be created under it"),
        ("--trace", "a_folder", "that is a folder; name a file"),
        ("--losses", "a_file/deeper/losses.json", "a_file is a file, so nothing can be created under it"),
        ("--checkpoint-dir", "a_file", "that is a file; name a folder"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_training(
    command, tmp_path, flag, where, complaint
):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder").mkdir()
    before = sorted(tmp_path.rglob("*"))
    code, out, err = command("train", "--steps", "1", flag, str(tmp_path / where))
    assert (code, out) == (2, "")  # no headline: no process group was started
    assert err == f"pipeclock train: error: {flag} {tmp_path / where}: {complaint}\n".replace(
        "a_file is", f"{tmp_path / 'a_file'} is"
    )
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("args", [["schedule", "1f1b", "-p", "2", "-m", "2"], ["plan", "--params", "1e9"]])
def test_schedule_and_plan_refuse_an_unwritable_png_before_their_work(command, tmp_path, args):
    code, out, err = command(*args, "--png", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == f"pipeclock {args[0]}: error: --png {tmp_path}: that is a folder; name a file\n"


def test_outputs_in_folders_yet_to_be_made_are_written_and_the_final_line_follows(command, tmp_path):
    png, losses = tmp_path / "new" / "timeline.png", tmp_path / "other" / "deeper" / "losses.json"
    flags = ["--hidden", "16", "--layers", "2", "--batch-size", "4", "--microbatches", "2", "--steps", "2"]
    code, out, err = command("train", *flags, "--png", str(png), "--losses", str(losses))
    assert (code, err) == (0, "")
    assert png.read_bytes()[:4] == b"\x89PNG" and '"losses": [' in losses.read_text()
    assert out.splitlines()[-1].startswith("final loss ")


def _start_training(launcher: list[str], **popen) -> subprocess.Popen:
    """A long MLP run whose stdout we read, in its own process group (as a terminal's foreground job)."""
    flags = [
        "--hidden",
        "32",
        "--layers",
        "4",
        "--batch-size",
        "4",
        "--microbatches",
        "2",
        "--steps",
        "10000",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [*launcher, "-m", "pipeclock", "train", *flags]
    return subprocess.Popen(command, cwd=ROOT, env=env, text=True, start_new_session=True, **popen)


def test_ctrl_c_under_torchrun_is_one_line_per_rank_and_no_traceback(tmp_path):
    """Ctrl-C reaches torchrun and every rank at once (one process group), as in a terminal.

    torchrun itself then reports the signal with a traceback of its own frames; each rank's stderr goes to
    its own file (``--redirects 2``) so that what pipeclock prints can be told apart.
    """
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    launcher += ["--log-dir", str(tmp_path), "--redirects", "2"]
    process = _start_training(launcher, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    signal_group_when(process, "step ", signal.SIGINT, DEADLINE)
    launcher_output = process.stdout.read() + process.stderr.read()
    ranks = {}
    for path in glob.glob(str(tmp_path / "*" / "attempt_0" / "*" / "stderr.log")):
        ranks[int(Path(path).parent.name)] = Path(path).read_text()
    assert sorted(ranks) == [0, 1], launcher_output
    for rank, err in ranks.items():
        assert err.startswith(f"rank {rank}: interrupted at step "), err
        assert err.count("\n") == 1, err
    package = f"{ROOT / 'pipeclock'}{os.sep}"  # not the venv's paths, which a clone named pipeclock/ has
    assert package not in launcher_output  # torchrun's own report names none of our frames


def test_sigterm_ends_a_run_with_one_line_and_128_plus_the_signal(tmp_path):
    process = _start_training([sys.executable], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    signal_group_when(process, "step ", signal.SIGTERM, DEADLINE)
    assert process.returncode == 128 + signal.SIGTERM
    err = process.stderr.read()
    assert err.startswith("rank 0: stopped by SIGTERM at step ") and err.count("\n") == 1, err


def test_an_interrupt_names_the_step_the_rank_is_in():
    seen = StepsSeen()
    assert seen.where() == "before the first step"  # still setting up
    seen.begin(10)  # a run resumed at step 10
    assert seen.where() == "at step 10"  # in step 10, perhaps still in its optimizer step
    seen(10, 0.5)
    assert seen.where() == "at step 11"


def two_trains_rank_0_slow_to_leave_the_first(rank: int, world: int) -> list[tuple[int, str]]:
    """Two ``train`` commands in a row on the same ranks; rank 0 leaves the first one's process group
    two seconds after rank 1 has left it (as a rank still writing its outputs does)."""
    import time

    from pipeclock import comms
    from tests.distributed import command

    leave = comms.shutdown
    if rank == 0:
        comms.shutdown = lambda: (time.sleep(2), leave())[1]
    argv = ["train", "--hidden", "8", "--layers", "2", "--steps", "2", "--batch-size", "4", "--timeout", "20"]
    try:
        first = command(rank, world, argv)
    finally:
        comms.shutdown = leave
    second = command(rank, world, argv)
    return [(first.code, first.err), (second.code, second.err)]


def test_commands_run_in_a_row_on_the_same_ranks_start_each_one_together():
    from tests.distributed import run_ok

    for rank, ran in enumerate(run_ok(two_trains_rank_0_slow_to_leave_the_first, 2, deadline=DEADLINE)):
        assert ran == [(0, ""), (0, "")], (rank, ran)
