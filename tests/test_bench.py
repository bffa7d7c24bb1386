"""The benchmark runs end to end on a tiny configuration and writes its tables and plots (speed is not
asserted); the plots can be redrawn from the saved results alone, as `make docs` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.long  # 36-40 s of make test on 2 cores; CI runs it
def test_bench_command_runs_a_tiny_sweep_and_writes_json_markdown_and_plots(tmp_path):
    command = ["bench", "--tiny", "--results-dir", str(tmp_path), "--figures-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "pipeclock", *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    results = json.loads((tmp_path / "tiny.json").read_text())
    records = results["runs"][0]
    cases = [r for r in records if r["kind"] == "case"]
    assert {c["schedule"] for c in cases} == {"1f1b", "zb-h1"}
    assert all(c["check"]["compared"] and c["check"]["grad_gap"] <= 1e-4 for c in cases)
    assert all(set(c["engines"]) == {"pipeclock", "torch"} for c in cases)
    assert any(r["kind"] == "baseline" for r in records)
    assert any(r["kind"] == "overhead" for r in records)
    assert next(r for r in records if r["kind"] == "setup")["threads"] == [1, 1]

    table = (tmp_path / "tiny.md").read_text()
    assert "| 2 | 64 | 2 | 1f1b |" in table and "| 2 | 64 | 2 | zb-h1 |" in table
    assert "## Engine overhead" in table
    assert sorted(p.name for p in tmp_path.glob("bench_*.png")) == [
        "bench_efficiency_vs_m.png",
        "bench_step_vs_m.png",
        "bench_step_vs_p.png",
    ]

    redrawn = tmp_path / "redrawn"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.figures",
            str(tmp_path / "tiny.json"),
            "--figures-dir",
            str(redrawn),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for plot in tmp_path.glob("bench_*.png"):
        assert (redrawn / plot.name).read_bytes() == plot.read_bytes(), f"{plot.name} redrawn differently"
