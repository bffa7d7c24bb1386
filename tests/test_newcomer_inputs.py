"""What a newcomer tries on a fresh clone, and what each unusual input must give: the work, or one line.

Each case here was once a traceback, a hang or a silent wrong answer. The multi-process ones share a
launch where they can; the in-process ones run ``python -m pipeclock`` as ``main([...])``.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from pipeclock.cli.dispatch import main

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ["--model", "gpt", "--dim", "16", "--layers", "1", "--heads", "2", "--seq-len", "16",
            "--steps", "1", "--batch-size", "2", "--microbatches", "1", "--eval-batches", "1"]  # fmt: skip


def run_command(*argv: str) -> tuple[int, str, str]:
    """``python -m pipeclock ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def one_line(code: int, stderr: str, prefix: str) -> str:
    """The one error line a refusal printed (exit 2, no traceback), without its prefix."""
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, (code, stderr)
    assert stderr.startswith(prefix), stderr
    return stderr[len(prefix) :].strip()


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    """A one-step GPT checkpoint, small enough to generate from at once."""
    directory = tmp_path_factory.mktemp("gpt") / "run"
    code, _, err = run_command("train", *TINY_GPT, "--checkpoint-dir", str(directory))
    assert code == 0, err
    return directory


# --- generate ------------------------------------------------------------------------------------------


def test_the_decode_program_made_as_it_is_walked_is_the_lowered_one():
    from pipeclock.generation.decode_program import decode_instructions, decode_program

    for p in range(1, 5):
        for groups in range(1, 4):
            for tokens in range(8):
                lowered = decode_program(p, groups, tokens)
                for rank in range(p):
                    made = list(decode_instructions(p, groups, tokens, rank))
                    assert made == lowered[rank], (p, groups, tokens, rank)
                    assert [i.action for i in made] == [i.action for i in lowered[rank]]


def test_a_billion_tokens_stream_from_the_first_byte_and_ctrl_c_ends_with_one_line(gpt_run):
    """The decode program is made as it is walked: the first bytes come at once, whatever --tokens asks."""
    command = [sys.executable, "-m", "pipeclock", "generate", str(gpt_run), "--prompt", "def ",
               "--tokens", "1000000000", "--temperature", "0"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        printed, deadline = b"", time.monotonic() + 120
        while len(printed) < len("def ") + 64 and time.monotonic() < deadline:
            if select.select([process.stdout], [], [], 1.0)[0]:
                printed += os.read(process.stdout.fileno(), 4096)
        assert len(printed) >= len("def ") + 64, f"only {printed!r} in 120 s"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    assert stderr.decode().splitlines()[-1] == "rank 0: interrupted", stderr.decode()
    assert "Traceback" not in stderr.decode()


def test_a_tokenizer_that_no_longer_fits_the_model_is_one_line(tmp_path):
    """Training refuses a tokenizer with ids beyond the vocabulary; so do generate and export, when the
    tokenizer a run was trained with was replaced by such a one since."""
    from tests.hf_cases import model_with_tokenizer

    text = Path(json.__file__).read_text()
    (tmp_path / "corpus.txt").write_text(text)
    model_with_tokenizer(tmp_path / "model", text, vocab_size=300)
    code, _, err = run_command(
        "train", "--model", "hf", "--hf-model", str(tmp_path / "model"),
        "--data", str(tmp_path / "corpus.txt"), "--seq-len", "8", "--steps", "1", "--batch-size", "2",
        "--microbatches", "1", "--eval-batches", "1", "--checkpoint-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 0, err
    vocabulary = json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    model_with_tokenizer(tmp_path / "other", text, vocab_size=400)  # a larger tokenizer in its place
    for name in os.listdir(tmp_path / "other"):
        if name.startswith(("tokenizer", "special_tokens")):
            os.replace(tmp_path / "other" / name, tmp_path / "model" / name)
    wanted = f"now gives 400 ids, more than the model's vocabulary of {vocabulary}"
    generated = run_command("generate", str(tmp_path / "run"), "--prompt", "def f", "--tokens", "4")
    assert wanted in one_line(*generated[::2], "pipeclock generate: error: ")
    exported = run_command("export", str(tmp_path / "run"), "--hf", str(tmp_path / "out"))
    assert wanted in one_line(*exported[::2], "pipeclock export: error: ")
