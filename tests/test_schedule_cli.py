"""``pipeclock schedule``: the command-line way to see a schedule without starting processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeclock.cli.dispatch import main
from pipeclock.engine.generators import SCHEDULES, one_f_one_b
from pipeclock.observe.diagrams import ascii_diagram
from pipeclock.observe.simulate import simulate


@pytest.fixture
def schedule_command(monkeypatch, capsys):
    """Run ``pipeclock schedule ARGS`` in this process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["pipeclock"])

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["schedule", *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_showing_a_schedule_prints_its_diagram_bubble_formula_and_peaks(schedule_command):
    code, out, err = schedule_command("1f1b", "--stages", "4", "--microbatches", "8")
    assert (code, err) == (0, "")
    assert ascii_diagram(simulate(one_f_one_b(4, 8))) in out
    assert "makespan          33\n" in out
    assert "bubble            27.3% of the step (simulated); formula (p-1)/(m+p-1) = 27.3%" in out
    assert "bubble vs ideal   37.5%" in out
    assert "peak activations  4 3 2 1" in out


def test_a_split_schedule_says_which_first_stage_backwards_the_engine_runs_whole(schedule_command):
    """The engine joins stage 0's I and W when W follows at once (``join_first_stage_backwards``); what
    the command draws is the schedule as written, so it says so. Nothing to say where nothing is split."""
    joined = "as run            stage 0's I, W pairs run as one B ({} of 4 micro-batches)"
    assert joined.format(4) in schedule_command("zb-h1", "-p", "2", "-m", "4")[1]
    assert joined.format(2) in schedule_command("dualpipev", "-p", "2", "-m", "4")[1]
    assert "as run" not in schedule_command("1f1b", "-p", "2", "-m", "4")[1]


def test_an_interleaved_schedule_takes_chunks_and_counts_time_in_stages(schedule_command):
    code, out, _ = schedule_command("interleaved-1f1b", "-p", "4", "-m", "8", "--chunks", "2")
    assert code == 0
    assert "2 chunks per rank" in out
    assert "makespan          28.5\n" in out  # 3 * (2 * 8 + 4 - 1) chunk steps of half a stage
    assert "formula (p-1)/(v*m+p-1) = 15.8%" in out


def test_costs_and_latency_change_the_simulation(schedule_command):
    _, out, _ = schedule_command("gpipe", "-p", "2", "-m", "2", "--costs", "1,2,1", "--link-latency", "0.5")
    # A message leaves once its receive is posted, just before the compute that uses it (B = I + W = 3).
    # Rank 1: F0 1.5-2.5; F1 sent at 2 but posted at 2.5, so 3-4; B0 4-7, B1 7-10.
    # Rank 0: B0's gradient posted at 2, sent at 7: 7.5-10.5; B1's sent at 10, posted at 10.5: 11-14.
    assert "makespan          14\n" in out


def test_compare_prints_one_row_per_schedule_and_draws_one_png(schedule_command, tmp_path):
    png = tmp_path / "compare.png"
    code, out, _ = schedule_command("--compare", "-p", "4", "-m", "8", "--png", str(png))
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[2:] if line.split()[0] in SCHEDULES}
    assert list(rows) == list(SCHEDULES)
    assert rows["1f1b"].split()[1:4] == ["33", "27.3%", "27.3%"]
    assert rows["1f1b"].endswith("4 3 2 1")
    assert rows["zb-h1"].split()[1:3] == ["27", "11.1%"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_png_draws_the_single_schedule(schedule_command, tmp_path):
    png = tmp_path / "1f1b.png"
    code, out, _ = schedule_command("1f1b", "-p", "2", "-m", "3", "--png", str(png))
    assert code == 0
    assert f"drew {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["pipedream", "-p", "2", "-m", "2"], "unknown schedule 'pipedream'; known schedules: naive"),
        (["1f1b", "-p", "two", "-m", "2"], "argument --stages/-p: must be a positive integer, got 'two'"),
        (["1f1b", "-p", "2", "-m", "0"], "argument --microbatches/-m: must be a positive integer, got 0"),
        (["1f1b", "-m", "2"], "--stages is required"),
        (["gpipe", "-p", "2", "-m", "2", "--chunks", "2"], "one chunk per rank"),
        (["1f1b", "-p", "2", "-m", "2", "--costs", "1,2"], "--costs must be three numbers"),
        (["1f1b", "-p", "2", "-m", "2", "--link-latency", "-1"], "--link-latency: must be a number >= 0"),
        (["-p", "2", "-m", "2"], "name a schedule"),
    ],
)
def test_a_bad_request_is_one_line_and_exit_code_2(schedule_command, args, complaint):
    code, out, err = schedule_command(*args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("pipeclock schedule: error: ")
    assert complaint in err


@pytest.mark.timeout(60)  # the refusal comes before any work: a command that simulates first never ends
@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (
            ["1f1b", "-p", "4", "-m", "100000"],
            "--microbatches 100000: the engine runs at most 65535 per step",
        ),
        (["1f1b", "-p", "100000", "-m", "4"], "--stages 100000: the engine runs at most 512 virtual stages"),
        (
            ["interleaved-1f1b", "-p", "300", "-m", "4"],
            "--stages 300 x 2 chunks: the engine runs at most 512",
        ),
        (["1f1b", "-p", "8", "-m", "20000"], "is 160000 forwards per step: schedule simulates at most 50000"),
        (["--compare", "-p", "8", "-m", "5000"], "x 2 chunk(s) is 80000 forwards per step"),
    ],
)
def test_a_step_too_large_to_simulate_is_one_line_before_any_work(schedule_command, args, complaint):
    code, out, err = schedule_command(*args)
    assert (code, out, err.count("\n")) == (2, "", 1), err
    assert err.startswith("pipeclock schedule: error: ") and complaint in err, err


def test_a_deadlocked_schedule_file_shows_where_every_rank_is_stuck(schedule_command, tmp_path):
    """The error's first line says it deadlocks; the lines after it are the answer, so all are shown."""
    csv = tmp_path / "stuck.csv"
    csv.write_text("0F0,0F1,0B1,0B0\n1B0,1F0,1F1,1B1\n")
    code, out, err = schedule_command("--schedule-csv", str(csv))
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"pipeclock schedule: error: {csv}: the schedule deadlocks; no rank can move:",
        "  rank 0: stuck at B1 (action 2), waiting for B1 (or I1) on rank 1",
        "  rank 1: stuck at B0 (action 0), waiting for F0 on rank 1",
    ]


def test_python_dash_m_pipeclock_schedule_works():
    result = subprocess.run(
        [sys.executable, "-m", "pipeclock", "schedule", "gpipe", "--stages", "2", "--microbatches", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "rank 1 |...F0 F1 B0    B1    ......|" in result.stdout


def test_output_into_a_closed_pipe_ends_quietly():
    """``pipeclock schedule ... | head`` closes the pipe early: no BrokenPipeError traceback."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "pipeclock", "schedule", "1f1b", "-p", "2", "-m", "4"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the command writes anything
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0 and stderr == ""


TORCH_FREE_COMMANDS = [
    ["schedule", "1f1b", "--stages", "4", "--microbatches", "8"],
    ["schedule", "--compare", "--stages", "4", "--microbatches", "8", "--png", "compare.png"],
    ["schedule", "zb-v", "-p", "4", "-m", "8", "--save-csv", "zbv.csv"],
    ["schedule", "--schedule-csv", "zbv.csv"],
    ["schedule", "1f1b", "-p", "2", "-m", "3", "--program"],
    ["plan", "--params", "20e9", "--layers", "64", "--stages", "16", "--microbatches", "8"],
    ["plan", "--cluster", "8xH100-80GB", "--params", "10e9"],
]


def test_the_simulators_and_the_planners_commands_import_no_torch(tmp_path):
    """The course's most typed commands start without torch's import (2 of a schedule command's 3 s on
    2 cores, 2 of a plan's 2.7 s); only a program on a dp or tp mesh asks torch for its layout, and only a
    plan that measures a model (or reads a Hugging Face config, through transformers) imports it."""
    script = "\n".join(
        [
            "import contextlib, io, sys",
            "from pipeclock.cli.dispatch import main",
            f"for words in {TORCH_FREE_COMMANDS!r}:",
            "    with contextlib.redirect_stdout(io.StringIO()):",
            "        assert main(words) == 0, words",
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torch'))",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", "a simulator or planner command imported torch"
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
