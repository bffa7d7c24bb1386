"""The labs run as a learner runs them, and each prints its lesson."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeclock.cli.commands.lab import environment
from tests.commands import run_lab_forked, run_once
from tests.jobs import signal_group_when

LABS = Path(__file__).resolve().parents[1] / "labs"


def run_lab_in_process(name: str, args: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(LABS / name), run_name="__main__")
    return capsys.readouterr().out


def run_lab_command(number: int, *args: str) -> str:
    """``python -m pipeclock lab NUMBER ARGS``, its script on forked ranks (``tests.commands``)."""
    done = run_lab_forked(shlex.join(["python", "-m", "pipeclock", "lab", str(number), *args]))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_lab1_baseline_learns_by_a_large_factor():
    out = run_once("python -m pipeclock lab 1").output()  # the run its page quotes
    assert "parameters: 1,052,672 (4.0 MiB of fp32 weights)" in out
    fell = r"loss fell from ([\d.]+) at step 0 to ([\d.]+) at step 99 \((\d+)x\); the last 5 steps average "
    first, last, factor = re.search(fell, out).groups()
    assert float(first) / float(last) >= 10 and int(factor) >= 10
    printed = dict(re.findall(r"^step +(\d+)  loss ([\d.]+)$", out, re.MULTILINE))
    assert (first, last) == (printed["0"], printed["99"]), "it quotes the first and the last step's losses"
    assert re.search(r"step time [\d.]+ ms \(median\), [\d,]+ samples/s", out)


def test_lab2_prints_the_memory_wall_and_the_split_matches_the_whole_model():
    out = run_once("python -m pipeclock lab 2").output()  # the run its page quotes: 20 steps
    assert re.search(r"weights alone\s+40 GB\s+vs 24 GB on an RTX 4090", out)
    assert re.search(r"Adam's two moments\s+160 GB", out)
    assert "devices to train with Adam:       7" in out
    assert "hand-off: an activation of shape (64, 256) forward, its gradient back" in out
    gaps = re.search(r"loss (\S+)\s+gradients (\S+)\s+weights after training (\S+)", out).groups()
    assert all(float(gap) <= 1e-6 for gap in gaps)


@pytest.mark.slow
def test_lab3_ping_pong_runs_two_processes_and_the_tensor_comes_back_intact():
    out = run_once("python -m pipeclock lab 3").output()
    assert out.startswith("$ torchrun --nproc-per-node 2 labs/03_ping_pong.py")
    pids = set(re.findall(r"rank [01] of world size 2: PID (\d+)", out))
    assert len(pids) == 2, "two separate processes"
    assert re.search(r"rank 1: received \[0, 1, 2, 3, 4, 5, 6, 7\]: intact", out)
    assert re.search(
        r"rank 0: sent \[0, 1, 2, 3, 4, 5, 6, 7\], got back \[1, 2, 3, 4, 5, 6, 7, 8\]: intact", out
    )
    rows = re.findall(r"^\s*([\d]+ \w?i?B)\s+([\d.]+) us\s+([\d.]+) MiB/s$", out, re.MULTILINE)
    assert [size for size, _, _ in rows] == ["4 B", "1 KiB", "64 KiB", "1 MiB", "8 MiB"]
    assert all(float(us) > 0 for _, us, _ in rows)


def test_a_labs_threads_share_the_cores_and_sleep_while_they_wait_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = environment(nproc=2)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert environment(nproc=1)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_an_unknown_lab_is_a_clear_error():
    done = subprocess.run([sys.executable, "-m", "pipeclock", "lab", "99"], capture_output=True, text=True)
    assert done.returncode != 0 and "no lab 99" in done.stderr


# --- labs 4-8: the schedules, measured. Each test reads the run its page quotes (tests/commands.py runs
# it once for both). The facts that do not depend on timing (formulas, peak activation bytes, message
# counts, gradients) are checked exactly, the timed ones only loosely, since other processes may share
# the cores.


def lab_run(command: str) -> str:
    """The output of a lab command quoted in the docs; every figure it says it drew was written by it."""
    run = run_once(command)
    out = run.output()
    drawn = re.findall(r"drawn to (\S+)$", out, re.MULTILINE)
    assert drawn and all(run.wrote(path) for path in drawn), drawn
    return out


def percents(text: str) -> list[float]:
    return [float(value) / 100 for value in re.findall(r"([\d.]+)%", text)]


def lesson_line(out: str, starts_with: str) -> str:
    lesson = out[out.index("\nlesson:") :]
    return next(line for line in lesson.splitlines() if line.strip().startswith(starts_with))


def check_the_hand_written_loop_computes_what_the_engine_does(out: str, loop: str, formula: str) -> None:
    """The lab's loop (labs/solutions/) beside the engine: same loss, same gradients, both bubbles."""
    assert f"the loop of labs/solutions/{loop}.py beside the engine" in out
    loop_loss, engine_loss = map(float, re.search(r"loss +(\S+) \(loop\) vs (\S+) \(engine\)", out).groups())
    assert loop_loss == pytest.approx(engine_loss, rel=1e-5)
    gap, largest = map(
        float, re.search(r"gradients +differ by at most (\S+) \(largest (\S+)\)", out).groups()
    )
    assert largest > 0 and gap <= 1e-5 * largest
    bubbles = re.search(r"measured bubble  loop ([\d.]+)% vs engine ([\d.]+)%; formula (.*)$", out, re.M)
    assert bubbles and bubbles[3] == formula and all(0 < float(b) < 100 for b in bubbles.groups()[:2])


@pytest.mark.slow
def test_lab4_naive_keeps_each_rank_busy_about_one_pth_of_the_step():
    out = lab_run("python -m pipeclock lab 4 --nproc 4 --hidden 512 --layers 8 --steps 4")
    assert out.startswith("$ torchrun --nproc-per-node 4 labs/04_naive.py")
    *busy, one_over_p = percents(lesson_line(out, "busy share of the step"))
    assert one_over_p == 0.25 and len(busy) == 4
    # one rank computes at a time, so the shares add up to about one step, each a part of it (how the
    # step divides between the ranks moves with the machine's load: one took 3 % on a busy one)
    assert all(0 < share < 1 for share in busy) and 0.5 <= sum(busy) <= 1.2, busy
    assert "vs formula (p-1)/p = 75.0%" in lesson_line(out, "measured bubble")
    assert re.search(r"^\s+3\s+[\d.]+%\s+\d+%\s+25.0%", out, re.MULTILINE), "CPU % printed beside 1/p"
    check_the_hand_written_loop_computes_what_the_engine_does(out, "naive", "(p-1)/p = 75.0%")


@pytest.mark.slow
def test_lab5_gpipe_bubble_falls_as_the_number_of_micro_batches_grows():
    out = lab_run("python -m pipeclock lab 5 --microbatches 1 4 --hidden 512 --layers 8 --steps 3")
    measured = percents(lesson_line(out, "measured bubble"))
    formula = percents(lesson_line(out, "formula (p-1)/(m+p-1)"))
    assert formula == [0.5, 0.2]
    # whether m = 4 measures below m = 1 depends on the machine's load (the page shows it on a quiet
    # one); that with m = 1 each rank waits while the other works does not
    assert measured[0] > 0.3, "with m = 1 at least one rank always waits"
    check_the_hand_written_loop_computes_what_the_engine_does(out, "gpipe", "(p-1)/(m+p-1) = 20.0%")


@pytest.mark.slow
def test_lab6_1f1b_holds_min_m_p_minus_r_micro_batches_where_gpipe_holds_m():
    out = lab_run("python -m pipeclock lab 6 --nproc 4 --hidden 512 --layers 8 --steps 2")
    assert "(formula (p-1)/(m+p-1) = 27.3% for both)" in lesson_line(out, "measured bubble")
    for rank in range(4):
        held = min(8, 4 - rank)
        line = lesson_line(out, f"peak activations rank {rank}")
        gpipe, one_f_one_b, ratio = re.search(
            r"GPipe ([\d.]+) MiB vs 1F1B ([\d.]+) MiB, ([\d.]+)x less", line
        ).groups()
        assert float(one_f_one_b) < float(gpipe)
        assert float(ratio) == pytest.approx(8 / held, abs=0.005) and f"(m / min(m, p-r) = 8/{held})" in line
    check_the_hand_written_loop_computes_what_the_engine_does(out, "one_f_one_b", "(p-1)/(m+p-1) = 27.3%")


@pytest.mark.slow
def test_lab7_interleaving_shrinks_the_formula_bubble_for_more_messages():
    out = lab_run("python -m pipeclock lab 7 --chunks 4 --hidden 512 --layers 8 --steps 2")
    bubble = lesson_line(out, "measured bubble")
    assert "formula (p-1)/(m+p-1) = 20.0% vs (p-1)/(v*m+p-1) = 5.9%" in bubble
    messages = lesson_line(out, "messages per step per rank")
    # v = 4 chunks on 2 ranks: 7 of the 8 virtual stages' boundaries cross ranks, against 1
    assert "1F1B 8, 8 vs interleaved 56, 56 (7.0x)" in messages
    growth = re.search(r"MiB \(([\d.]+)x, ([\d.]+)x\)", lesson_line(out, "peak activations")).groups()
    assert all(float(g) > 1 for g in growth), "interleaving holds a little more"
    check_the_hand_written_loop_computes_what_the_engine_does(out, "interleaved", "(p-1)/(v*m+p-1) = 5.9%")


@pytest.mark.slow
def test_lab8_zero_bubble_has_the_same_gradients_as_1f1b_and_a_smaller_formula_bubble():
    out = lab_run("python -m pipeclock lab 8 --hidden 512 --layers 8 --steps 2")
    bubble = lesson_line(out, "measured bubble")
    assert "formula (p-1)/(m+p-1) = 20.0% vs (p-1)/(3m+p-1) = 7.7%" in bubble
    gradients = lesson_line(out, "gradients after one step")
    difference, largest, loss_1f1b, loss_zb = re.search(
        r"= (\S+) \(largest gradient (\S+)\); losses (\S+) and (\S+)", gradients
    ).groups()
    assert float(largest) > 0 and float(difference) <= 1e-6 * float(largest)
    assert abs(float(loss_1f1b) - float(loss_zb)) <= 1e-6
    rank1 = re.search(r"peak activations, rank 1\s+([\d.]+) MiB\s+([\d.]+) MiB", out).groups()
    assert float(rank1[1]) > 2 * float(rank1[0]), "ZB-H1's last rank holds p micro-batches, each until W"


def test_nproc_after_the_lab_number_goes_to_torchrun_not_to_the_lab(monkeypatch):
    from pipeclock.cli.commands.lab import command, find_lab, take_nproc

    monkeypatch.chdir(LABS.parent)
    nproc, lab_args = take_nproc(["--steps", "3", "--nproc", "4", "--out", "x"])
    assert (nproc, lab_args) == (4, ["--steps", "3", "--out", "x"])
    _, shown = command(find_lab(4), lab_args, nproc)
    assert shown == "torchrun --nproc-per-node 4 labs/04_naive.py --steps 3 --out x"
    assert command(find_lab(4), [])[1] == "torchrun --nproc-per-node 2 labs/04_naive.py"


def test_messages_per_rank_counts_each_activation_and_gradient_crossing_between_ranks():
    from pipeclock.engine.generators import generate
    from pipeclock.observe.report import messages_per_rank

    m = 8
    # one chunk: the end ranks talk to one neighbour, the middle ones to two; m each way per neighbour
    assert messages_per_rank(generate("1f1b", 4, m)) == [2 * m, 4 * m, 4 * m, 2 * m]
    assert messages_per_rank(generate("zb-h1", 4, m)) == [2 * m, 4 * m, 4 * m, 2 * m], "W sends nothing"
    # two chunks on 2 ranks: virtual stages 0 1 2 3 alternate ranks, so all 3 boundaries cross
    assert messages_per_rank(generate("interleaved-1f1b", 2, m, 2)) == [3 * 2 * m, 3 * 2 * m]


@pytest.mark.slow
def test_lab10_replicas_give_the_one_process_loss_and_the_pipeline_sends_what_the_formula_says():
    out = run_lab_command(10, "--hidden", "256", "--layers", "4", "--batch-size", "31", "--steps", "3")
    assert out.startswith("$ torchrun --nproc-per-node 4 labs/10_data_parallel.py")
    assert "replica 1  rank 2  -- rank 3" in out
    losses = re.findall(r"^first-step loss  (\S+) \(one process, whole batch: (\S+)\)$", out, re.M)
    assert len(losses) == 2 and all(ours == alone for ours, alone in losses), losses
    counted = re.findall(r"^pp messages\s+(\S+) MB per step counted; .* = (\S+) MB$", out, re.M)
    assert len(counted) == 2 and all(ours == formula for ours, formula in counted), counted
    sums = re.findall(r"^  rank \d: (?:[FB]\d )+.*\[dp sum", out, re.M)
    assert len(sums) == 4, "each rank of replica 0 sums its gradients after its backwards, with both engines"


# --- lab 11: the run its page quotes (checked line by line by the docs test), and its figures keep their
# relations. Timings are never compared.


def whole(text: str) -> int:
    return int(text.replace(",", ""))


def check_recompute_keeps_less_and_computes_the_same(out: str) -> None:
    rows = re.findall(r"^  (none|every-2|full) +([\d.]+) / ([\d.]+) MiB +[\d.]+ ms +([\d.]+)$", out, re.M)
    assert [name for name, *_ in rows] == ["none", "every-2", "full"], out
    peaks = {name: (float(rank0), float(rank1)) for name, rank0, rank1, _ in rows}
    for rank in (0, 1):
        assert peaks["full"][rank] < peaks["every-2"][rank] < peaks["none"][rank], peaks
    assert len({loss for *_, loss in rows}) == 1, "the same last loss, to every printed digit"
    gaps = re.findall(r"the losses of all 4 steps differ from none's by at most (\S+);", out)
    assert len(gaps) == 2 and all(float(gap) <= 1e-6 for gap in gaps), gaps


def check_bf16_sends_half_the_float_bytes(out: str) -> None:
    rows = re.findall(r"^  (fp32|bf16) +([\d,]+) B / ([\d,]+) B ", out, re.M)
    sent = {dtype: [whole(rank0), whole(rank1)] for dtype, rank0, rank1 in rows}
    assert len(rows) == 2 and set(sent) == {"fp32", "bf16"}, out
    assert sent["fp32"][1] == 2 * sent["bf16"][1], "the last rank sends float gradients only"
    found = re.search(r"16 x 64 x 8 B = ([\d,]+) B; the rest is ([\d,]+) B -> ([\d,]+) B", out)
    positions, fp32_rest, bf16_rest = map(whole, found.groups())
    assert positions == 16 * 64 * 8 and fp32_rest == 2 * bf16_rest, "rank 0: int64 positions, halved floats"
    assert sent["fp32"][0] == fp32_rest + positions and sent["bf16"][0] == bf16_rest + positions


def check_the_planner_counts_the_meters_activations_with_and_without_recompute(out: str) -> None:
    rows = re.findall(
        r"^  recompute (none|every-2|full) +([\d.]+) / ([\d.]+) MiB \S+ +([\d.]+) / ([\d.]+) MiB", out, re.M
    )
    assert [policy for policy, *_ in rows] == ["none", "every-2", "full"], out
    for policy, *figures in rows:
        predicted_0, measured_0, predicted_1, measured_1 = map(float, figures)
        assert predicted_0 == pytest.approx(measured_0, rel=0.05, abs=0.01), policy
        assert predicted_1 == pytest.approx(measured_1, rel=0.05, abs=0.01), policy


@pytest.mark.slow
def test_lab11_recompute_keeps_less_for_the_same_loss_and_bf16_halves_the_bytes():
    out = run_once("python -m pipeclock lab 11").output()
    check_recompute_keeps_less_and_computes_the_same(out)
    check_bf16_sends_half_the_float_bytes(out)
    check_the_planner_counts_the_meters_activations_with_and_without_recompute(out)
    cuts = re.findall(r"^  (layers|time|memory) +(embed .*? head)  ", out, re.M)
    assert dict(cuts)["layers"] == "embed h0 h1 | h2 h3 head", "by count: three pieces each"
    assert dict(cuts)["memory"].index("|") < dict(cuts)["layers"].index("|"), "rank 0 holds 2 micro-batches"


def test_ctrl_c_ends_a_lab_with_one_line_per_rank_and_no_traceback(tmp_path):
    """Ctrl-C reaches torchrun and every rank at once, as in a terminal; each rank's stderr goes to a file
    of its own (``--redirects 2``), apart from torchrun's report of the signal."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    launcher += ["--log-dir", str(tmp_path), "--redirects", "2"]
    lab = [str(LABS / "04_naive.py"), "--hidden", "32", "--layers", "4", "--steps", "1000000"]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen([*launcher, *lab], cwd=LABS.parent, env=env, **pipes)
    signal_group_when(process, "naive schedule on 2 stages", signal.SIGINT, deadline=120)
    ranks = {int(path.parent.name): path.read_text() for path in tmp_path.glob("*/attempt_0/*/stderr.log")}
    assert ranks == {0: "rank 0: interrupted\n", 1: "rank 1: interrupted\n"}


# --- lab 12: tensor parallel. The run its page quotes; the slices, the collectives and the numbers are
# checked exactly (none depends on timing), the numbers against one process to 1e-5.


def numbers_after(label: str, line: str) -> dict[str, float]:
    """``output 3.5e-07, input gradient ...`` after ``label`` in ``line``, as a dict."""
    pairs = line.split(label, 1)[1].split(", ")
    return {" ".join(p.split()[:-1]): float(p.split()[-1]) for p in pairs}


@pytest.mark.slow
def test_lab12_splits_by_hand_and_by_torch_keep_the_same_slices_and_one_process_numbers():
    out = run_once("python -m pipeclock lab 12").output()
    assert out.startswith("$ torchrun --nproc-per-node 4 labs/12_tensor_parallel.py")
    hidden, width, tp = 64, 256, 4
    for rank in range(tp):
        rows = f"{rank * width // tp}-{(rank + 1) * width // tp - 1} of {width}"
        kept = f"up.weight rows {rows}, up.bias {rows}, down.weight columns {rows}, down.bias whole"
        assert out.count(f"  rank {rank} keeps  {kept}\n") == 2, "by hand and by torch, the same slices"
    held = (width * hidden + width) // tp + hidden * width // tp + hidden
    whole = width * hidden + width + hidden * width + hidden
    assert f"each rank keeps {held:,} of the MLP's {whole:,} parameters" in out
    assert out.count("collectives  forward: 1 all-reduce; backward: 1 all-reduce\n") == 2
    gaps = [line for line in out.splitlines() if line.startswith("  against ")]
    assert len(gaps) == 2
    for line in gaps:
        found = numbers_after("on any rank: ", line)
        assert set(found) == {"output", "input gradient", "weight gradients"}
        assert all(0 <= gap <= 1e-5 for gap in found.values()), line


@pytest.mark.slow
def test_lab12_pp_by_tp_draws_the_mesh_and_trains_as_one_process():
    out = run_once("python -m pipeclock lab 12").output()
    part = out[out.index("3. pp 2 x tp 2 on 4 processes") :]
    assert "tp rank 0  rank 0 ---------------> rank 2" in part, "tp rank t of a stage sends to tp rank t"
    assert "tp rank 1  rank 1 ---------------> rank 3" in part
    for rank in range(4):
        first, half = 2 * (rank // 2), f"{128 * (rank % 2)}-{128 * (rank % 2) + 127} of 256"
        assert (
            f"  rank {rank} holds  layers.{first}.weight rows {half}, layers.{first}.bias {half}, "
            f"layers.{first + 1}.weight columns {half}, layers.{first + 1}.bias whole" in part
        ), "each stage is one column-row pair, split between its two ranks"
    losses = re.findall(r"^ +(\d)  ([\d.]+) +([\d.]+)$", part, re.M)
    assert [step for step, *_ in losses] == ["0", "1", "2", "3", "4"]
    for _, ours, alone in losses:
        assert float(ours) == pytest.approx(float(alone), rel=1e-5)


# --- lab 13: the cluster planner, on paper. Its figures are the planner's; what is checked is that the
# lab's story holds together: the arithmetic of the memory wall, the comparison's errors, the bubble of
# 1F1B at m = p from the schedule's formula.


def gib(text: str) -> float:
    """``2.33 GiB`` or ``97.7 KiB`` in GiB."""
    number, unit = text.split()
    return float(number) * 1024.0 ** ("KMG".index(unit[0]) - 2)


def test_lab13_tells_the_memory_wall_and_sets_the_405b_plan_beside_the_published_run():
    out = run_once("python -m pipeclock lab 13").output()
    assert "nothing fits on 4xRTX4090 (96 GiB in all)" in out
    per_parameter, total = re.search(r"10B x (\d+) B = \d+ GB = (\d+) GiB", out).groups()
    assert int(total) == round(10e9 * int(per_parameter) / 2**30)
    sharded = float(re.search(r"sharded 4 ways .*, the 16 B of .* alone take ([\d.]+) GiB per GPU", out)[1])
    assert sharded == pytest.approx(10e9 * 16 / 4 / 2**30, abs=0.05), "all that ZeRO-3 shards, in 4"
    leanest = re.search(r"the leanest configuration .* needs ([\d.]+) GiB per GPU: (.*)$", out, re.M)
    parts = dict(re.findall(r"(\w+) ([\d.]+ [KMG]iB)", leanest[2]))
    assert set(parts) >= {"weights", "gradients", "optimizer", "allowance"}
    assert sum(map(gib, parts.values())) == pytest.approx(float(leanest[1]), abs=0.1), "the parts add up"
    assert gib(parts["gradients"]) + gib(parts["optimizer"]) == pytest.approx(sharded, abs=0.1)
    fewest, fewest_memory = re.search(
        r"the fewest RTX4090 that fit: (\d+),.* ([\d.]+) GiB per GPU$", out, re.M
    ).groups()
    assert int(fewest) > 4 and float(fewest_memory) <= 24
    assert float(re.search(r"the largest model of this shape .*: about ([\d.]+)B parameters", out)[1]) < 10

    rows = re.findall(
        r"^  (1f1b|interleaved-1f1b) +(\d+) +([\d.]+) +([+-][\d.]+)% +"
        r"([\d.]+) GiB +([\d.]+) GiB +([+-][\d.]+)%$",
        out,
        re.M,
    )
    assert [(name, published) for name, published, *_ in rows] == [
        ("1f1b", "100"),
        ("interleaved-1f1b", "128"),
    ]
    for _, published, predicted, error, published_gib, predicted_gib, memory_error in rows:
        assert float(error) == pytest.approx(100 * (float(predicted) / float(published) - 1), abs=0.06)
        assert float(memory_error) == pytest.approx(
            100 * (float(predicted_gib) / float(published_gib) - 1), abs=0.1
        )
        assert abs(float(error)) <= 15, "the plan is within the planner's target of the published speed"
    table = re.search(r"^1  ([\d.]+) .* (\d+\.\d)%   tp 8\+sp x pp 8 x dp 8, 1f1b, mbs 4 x m 8", out, re.M)
    assert round(float(table[1]), 1) == float(rows[0][2]), "the table and the comparison are the same plan"
    p = m = 8
    assert float(table[2]) == pytest.approx(100 * (p - 1) / (m + p - 1), abs=0.1), "1F1B's bubble at m = p"
    gains = re.search(
        r"published \+([\d.]+)%, predicted \+([\d.]+)% \(the simulated bubble ([\d.]+)% -> ([\d.]+)%\)", out
    )
    assert float(gains[1]) == pytest.approx(100 * (128 / 100 - 1)) and float(gains[2]) > 0
    assert float(gains[4]) < float(gains[3]) == float(table[2])


# --- the answers apart: a learner reads the exercise without the answer in view ------------------------


def folded(text: str, at: int) -> bool:
    """Whether position ``at`` of a page lies inside a ``<details>`` block (collapsed when rendered)."""
    return text.rfind("<details>", 0, at) > text.rfind("</details>", 0, at)


def test_the_reference_loops_and_the_wrong_answers_verdicts_are_folded_on_their_pages():
    docs = LABS.parent / "docs"
    for page in ("lab4-naive", "lab5-gpipe", "lab6-1f1b", "lab7-interleaved"):
        text = (docs / f"{page}.md").read_text()
        assert folded(text, text.index("<!-- loop: labs/solutions/")), f"{page} shows its answer unfolded"
    text = (docs / "lab12-tensor-parallel.md").read_text()
    for shown in ("$ python -m pipeclock lab 12 --check tests/wrong_tensor_parallel/", "all-reduce a *copy*"):
        assert folded(text, text.index(shown)), f"lab 12 shows {shown!r} unfolded"


def test_the_skeletons_give_the_contract_and_hints_not_the_schedules_formulas():
    for skeleton in sorted((LABS / "exercises").glob("*.py")):
        text = skeleton.read_text()
        assert "min(" not in text and "p - r - 1" not in text, f"{skeleton.name} hands out a warm-up formula"
        assert text.count("raise NotImplementedError") >= 1, f"{skeleton.name} is no longer a skeleton"
