"""The labs run as a learner runs them, and each prints its lesson."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parents[1] / "labs"


def run_lab_in_process(name: str, args: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(LABS / name), run_name="__main__")
    return capsys.readouterr().out


def run_lab_command(number: int, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pipeclock", "lab", str(number), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=LABS.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_lab1_baseline_learns_by_a_large_factor(monkeypatch, capsys):
    out = run_lab_in_process("01_baseline.py", [], monkeypatch, capsys)
    assert "parameters: 1,052,672 (4.0 MiB of fp32 weights)" in out
    first, last, factor = re.search(r"loss fell from ([\d.]+) to ([\d.]+) \((\d+)x\)", out).groups()
    assert float(first) / float(last) >= 10 and int(factor) >= 10
    assert re.search(r"step time [\d.]+ ms \(median\), [\d,]+ samples/s", out)


def test_lab2_prints_the_memory_wall_and_the_split_matches_the_whole_model(monkeypatch, capsys):
    out = run_lab_in_process("02_manual_split.py", ["--steps", "5"], monkeypatch, capsys)
    assert re.search(r"weights alone\s+40 GB\s+vs 24 GB on an RTX 4090", out)
    assert re.search(r"Adam's two moments\s+160 GB", out)
    assert "devices to train with Adam:       7" in out
    assert "hand-off: an activation of shape (64, 256) forward, its gradient back" in out
    gaps = re.search(r"loss (\S+)\s+gradients (\S+)\s+weights after training (\S+)", out).groups()
    assert all(float(gap) <= 1e-6 for gap in gaps)


@pytest.mark.slow
def test_lab3_ping_pong_runs_two_processes_and_the_tensor_comes_back_intact():
    out = run_lab_command(3, "--repeats", "5")
    assert out.startswith("$ torchrun --nproc-per-node 2 labs/03_ping_pong.py --repeats 5")
    pids = set(re.findall(r"rank [01] of world size 2: PID (\d+)", out))
    assert len(pids) == 2, "two separate processes"
    assert re.search(r"rank 1: received \[0, 1, 2, 3, 4, 5, 6, 7\]: intact", out)
    assert re.search(
        r"rank 0: sent \[0, 1, 2, 3, 4, 5, 6, 7\], got back \[1, 2, 3, 4, 5, 6, 7, 8\]: intact", out
    )
    rows = re.findall(r"^\s*([\d]+ \w?i?B)\s+([\d.]+) us\s+([\d.]+) MiB/s$", out, re.MULTILINE)
    assert [size for size, _, _ in rows] == ["4 B", "1 KiB", "64 KiB", "1 MiB", "8 MiB"]
    assert all(float(us) > 0 for _, us, _ in rows)


def test_an_unknown_lab_is_a_clear_error():
    done = subprocess.run([sys.executable, "-m", "pipeclock", "lab", "99"], capture_output=True, text=True)
    assert done.returncode != 0 and "no lab 99" in done.stderr
