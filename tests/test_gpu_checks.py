"""``benchmarks/gpu_checks.sh``, the prepared checks a machine with a GPU runs as it is: the script itself.

The checks run where a GPU is lent (their figures go to benchmarks/results/gpu.md). Here the script is run
with no time to spend: it must start from the shell as written, find its python and the checkout, know
its checks, and write its page, every check on it (skipped for want of time).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from benchmarks.gpu_checks import checks

ROOT = Path(__file__).resolve().parents[1]


def test_the_script_runs_as_written_and_its_page_lists_every_check(tmp_path):
    page = tmp_path / "gpu.md"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    script = ["bash", str(ROOT / "benchmarks" / "gpu_checks.sh"), "--budget", "0", "--out", str(page)]
    ran = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    text = page.read_text()
    assert text.startswith("# GPU checks: ") and "torch " + torch.__version__ in text
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in text.splitlines()[6:]}
    names = [check.name for check in checks(tmp_path, gpu=torch.cuda.is_available())]
    assert names and all(rows.get(name) == "skipped" for name in names), text
