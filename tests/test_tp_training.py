"""``train --tp``: the main job with tensor parallel inside each stage follows the one-process run step by
step and says what tp cost; its checkpoints resume on any layout whose tp splits the model, and export whole.
"""

from __future__ import annotations

import re

import pytest
import torch

from pipeclock.models import gpt
from tests.distributed import Started, command, printed, start_ranks
from tests.jobs import LAUNCH_TIMEOUT, losses_of
from tests.tp_cases import CALLS_PER_MICROBATCH, TOLERANCE

GPT_RUN = "--model gpt --dim 32 --layers 2 --heads 2 --seq-len 32 --batch-size 6 --microbatches 2"
GPT_RUN += " --dropout 0.1 --steps 5 --eval-batches 1 --eval-every 0 --clip-grad-norm 0.5"


def train(world: int, flags: list[str]) -> Started:
    """``python -m pipeclock ...`` on ``world`` ranks forked from the rank server, as torchrun starts it
    (the tests of torchrun itself are in tests/test_faults.py and tests/test_data_parallel_runs.py)."""
    return start_ranks(command, world, flags, deadline=LAUNCH_TIMEOUT)


def test_train_tp2_follows_the_one_process_run_step_by_step_and_says_what_tp_cost(tmp_path):
    """The main job at tp 2, Adam and clipping on split parameters, the tie and dropout: every step's
    loss is the one-process run's. Its summary gives the time inside tp's collectives beside the step;
    the one-process run's says nothing of tp."""
    flags = ["train", *GPT_RUN.split()]
    split = train(2, [*flags, "--tp", "2", "--losses", str(tmp_path / "tp2.json")])
    one = printed(train(1, [*flags, "--losses", str(tmp_path / "one.json")]))
    said_by_split = printed(split)
    assert "x tp 2" in said_by_split.splitlines()[0]
    _, want = losses_of(tmp_path / "one.json")
    _, got = losses_of(tmp_path / "tp2.json")
    assert len(got) == len(want) == 5
    # profiled: steps 2 and 4; at pp 1 each rank runs both stages' layers, so both stages' collectives
    said = re.search(
        r"^tensor parallel  inside its collectives ([\d.]+) ms of each rank's ([\d.]+) ms step call "
        r"\(([\d.]+)%; (\d+) calls a rank\), means over 2 step\(s\) profiled for it", said_by_split, re.M
    )  # fmt: skip
    assert said, said_by_split
    inside, call, share, calls = (float(x) for x in said.groups())
    assert 0 < inside < call and 0 < share < 100, said.group(0)
    assert calls == sum(CALLS_PER_MICROBATCH.values()) * 2, said.group(0)  # 2 micro-batches a step
    assert "tensor parallel" not in one and "tp coll" not in one, one
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < TOLERANCE, (got, want)


@pytest.mark.slow
def test_a_checkpoint_saved_at_pp2_x_tp2_resumes_at_pp4_and_at_tp2_x_pp1_and_exports_whole(tmp_path):
    """DCP saves each rank's shards of the split parameters with their place in the whole; any layout
    whose tp splits the model reads its own shards back: the next losses are the uninterrupted run's."""
    flags = ["train", *GPT_RUN.replace("--steps 5", "").split()]
    saved, more = [*flags, "--steps", "3"], [*flags, "--steps", "5", "--resume", str(tmp_path / "ck")]

    def losses(name: str) -> list[str]:
        return ["--checkpoint-dir", str(tmp_path / name), "--losses", str(tmp_path / f"{name}.json")]

    first = train(4, [*saved, "--tp", "2", "--checkpoint-dir", str(tmp_path / "ck")])
    printed(train(1, [*flags, "--steps", "5", *losses("one")]))
    printed(first)
    runs = {
        "pp4": train(4, [*more, *losses("pp4")]),
        "tp2": train(2, [*more, "--tp", "2", *losses("tp2")]),
    }
    _, want = losses_of(tmp_path / "one.json")
    for name, run in runs.items():
        assert "saved by 2 stage(s) x tp 2" in printed(run), name
        first_step, got = losses_of(tmp_path / f"{name}.json")
        assert first_step == 3 and len(got) == 2, (name, first_step, got)
        assert max(abs(g - w) / abs(w) for g, w in zip(got, want[3:], strict=True)) < TOLERANCE, (name, got)
    printed(train(1, ["export", str(tmp_path / "ck"), str(tmp_path / "whole.pt")]))
    config = gpt.GPTConfig(dim=32, layers=2, heads=2, seq_len=32, dropout=0.1, seed=0)
    whole = gpt.gpt_sequential(config)
    whole.load_state_dict(torch.load(tmp_path / "whole.pt"), strict=True)  # every tensor, whole-sized
