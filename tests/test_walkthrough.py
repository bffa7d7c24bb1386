"""The guide's walk-through, as a newcomer types it: documents and a tokenizer to a trained, exported model.

docs/guide/training.md's commands run word for word, in order, in a fresh folder that holds only links to
the checkout's ``docs/`` and virtual environment (as the repository's root would), and each leaves what
the page says it leaves. ``tensorboard --logdir`` starts a server: it runs with ``--inspect`` added, which
reads the same event files, prints what they hold and exits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guide" / "training.md"


def walkthrough_commands() -> list[str]:
    """The shell commands of the page's walk-through section, continuation lines joined."""
    text = PAGE.read_text()
    section = text[text.index("## The walk-through") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    joined = [re.sub(r"\\\n\s*", "", block) for block in blocks]
    return [line.strip() for block in joined for line in block.splitlines() if line.strip()]


def run(command: str, folder: Path) -> subprocess.CompletedProcess:
    if command.startswith(".venv/bin/tensorboard "):
        command += " --inspect"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        ["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.long
def test_the_walkthrough_takes_documents_to_a_trained_exported_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "docs").symlink_to(ROOT / "docs")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])
    commands = walkthrough_commands()
    tools = ["python", "python", "torchrun", "tensorboard", "python", "python"]
    assert [c.split()[0] for c in commands] == [f".venv/bin/{tool}" for tool in tools]
    outputs = [run(command, tmp_path) for command in commands]
    dataset = json.loads((tmp_path / "my-data" / "dataset.json").read_text())
    assert dataset["vocab_size"] == 2048 and dataset["splits"]["val"]["documents"] >= 1
    trained = outputs[2].stdout
    assert re.search(r"^final loss \d+\.\d+ after 60 steps$", trained, re.MULTILINE), trained[-2000:]
    records = [json.loads(line) for line in (tmp_path / "runs/my-model/logs/metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert records[-1]["step"] == 60 and losses[-1] < losses[0] - 1.0, "the model learns"
    assert all(r["grad_norm"] > 0 and r["lr"] > 0 for r in records if "loss" in r)
    assert "loss" in outputs[3].stdout  # TensorBoard reads the curves
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "my-model"), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "my-model"), local_files_only=True)
    assert model.config.vocab_size == len(tokenizer) == 2048
    written = outputs[5].stdout.splitlines()
    assert any(line.startswith("This module") for line in written), outputs[5].stdout
    assert "\ufffd" not in outputs[5].stdout, "text decoded by the tokenizer, not bytes"
