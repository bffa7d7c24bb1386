"""``train --compile``: each repeated block compiled, the loss curve eager's, and refusals in one line.

Inductor compiles on this CPU in tens of seconds, so the suite compiles the GPT on one process; two stages
and a Hugging Face Llama are the long tests'.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest

from pipeclock import cli
from pipeclock.training.loop import TrainConfig, train
from tests.distributed import run_ok
from tests.hf_cases import llama_config

GPT = dict(model="gpt", dim=32, layers=2, heads=2, seq_len=16, batch_size=4, microbatches=2, steps=4)
# Measured on this CPU: the tiny models here give eager's losses bit for bit; the benchmark's (4 x 256)
# within 3e-7 (benchmarks/results/compile.md). Inductor fuses differently per shape and machine.
TOLERANCE = 1e-5


def losses(rank: int, world: int, fields: dict) -> list[float]:
    return train(TrainConfig(**fields)).losses


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= TOLERANCE * abs(b), (step, a, b)


def test_compiled_gpt_blocks_follow_the_eager_loss_curve_with_dropout():
    fields = dict(GPT, dropout=0.1, eval_every=0)
    eager = train(TrainConfig(**fields)).losses
    compiled = train(TrainConfig(**fields, compile=True)).losses
    assert_close(compiled, eager)


@pytest.mark.long
def test_compiled_blocks_on_two_stages_follow_one_eager_process(tmp_path):
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps(llama_config().to_dict()))
    for fields in (dict(GPT, dropout=0.1), dict(GPT, model="hf", hf_config=str(llama))):
        fields |= dict(eval_every=0, measure_memory=False)
        eager = train(TrainConfig(**fields)).losses
        for ranks in run_ok(losses, 2, dict(fields, compile=True), deadline=600):
            assert_close(ranks, eager)


def error_of(*argv: str) -> tuple[int, str]:
    stderr = io.StringIO()
    with redirect_stderr(stderr), redirect_stdout(io.StringIO()):
        code = cli.main(list(argv))
    return code, stderr.getvalue().strip()


def test_compile_where_it_cannot_work_is_one_line(tmp_path):
    dropping = llama_config()
    dropping.attention_dropout = 0.1
    (tmp_path / "config.json").write_text(json.dumps(dropping.to_dict()))
    cases = {
        "the MLP": (["--model", "mlp"], "the MLP has none"),
        "recompute": (["--model", "gpt", "--recompute", "full"], "a recomputed block is not compiled"),
        "HF dropout": (
            ["--model", "hf", "--hf-config", str(tmp_path), "--seq-len", "16"],
            "attention_dropout=0.1",
        ),
    }
    for name, (flags, expected) in cases.items():
        code, message = error_of("train", "--compile", "--steps", "1", *flags)
        assert code == 2 and expected in message and message.count("\n") == 0, (name, message)
