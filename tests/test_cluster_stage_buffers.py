"""torch's pipeline stages of December 2024 in the cluster planner (`pipeclock.plan.stage_buffers`,
``Software(pipelining="torch-2024")``): every output kept to the step's end and a receive buffer a
micro-batch, a stage's gradients from its first backward, walked along each rank's own actions; what
brings torchtitan's pipeline rows within 10 % of the memory they published."""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

import pytest

from pipeclock.cli.dispatch import main
from pipeclock.engine.generators import generate
from pipeclock.plan.cluster_config import Job, Software
from pipeclock.plan.cluster_memory import gpu_memory, memory_floor
from pipeclock.plan.gpus import KINDS, Cluster
from pipeclock.plan.paper_model import gpt_model
from pipeclock.plan.search import configurations
from pipeclock.plan.stage_buffers import Held, most_held

TORCH = Software("bf16", pipelining="torch-2024")


def test_a_first_stage_ends_its_step_holding_every_output_and_every_gradient_buffer():
    """1F1B on two ranks, four micro-batches: with nothing else held, the first rank's most is at its
    last action, each micro-batch's output and the receive buffer of its gradient."""
    table = generate("1f1b", 2, 4)
    most = most_held(table[0], (0,), 1, 4, {0: 0.0}, 100.0, 1.0, lambda started: 0.0, late_gradients=True)
    assert most == Held(0.0, 4.0, 4.0, 0.0)


def test_the_last_stage_keeps_its_logits_and_a_receive_buffer_for_each_input():
    """The last rank's most is at its last forward: every micro-batch's logits, the last one's input
    (kept, in its receive buffer) and the three other inputs' buffers."""
    table = generate("1f1b", 2, 4)
    most = most_held(table[1], (1,), 1, 4, {1: 1.0}, 100.0, 1.0, lambda started: 0.0, late_gradients=True)
    assert most == Held(1.0, 400.0, 3.0, 0.0)  # the last input's buffer is the input it keeps


def test_a_second_stages_gradients_arrive_after_the_activations_have_begun_to_go():
    """Two stages a rank (interleaved 1F1B, four ranks, four micro-batches): at the first rank's most,
    eight micro-batch stages in flight, only its second stage has run a backward, so only its gradients
    are held; counted from the start, the first's would be too."""
    table = generate("interleaved-1f1b", 4, 4, 2)
    walk = [table[0], (0, 4), 7, 4, {0: 10.0, 4: 10.0}, 0.0, 0.0, lambda started: 25.0 * len(started)]
    assert most_held(*walk, late_gradients=True) == Held(80.0, 0.0, 0.0, 25.0)
    assert most_held(*walk, late_gradients=False) == Held(80.0, 0.0, 0.0, 50.0)


def test_the_floor_stays_under_what_torch_stages_hold():
    """A search rejects a configuration whose floor is over the GPU unread: under torch's stages too."""
    model, cluster, job = gpt_model(1024, 8, 16, 50304), Cluster(8, KINDS["H100-80GB"]), Job(16, 2048)
    for config in itertools.islice(configurations(model, cluster, job, {}), 0, None, 3):
        assert memory_floor(model, config, job, TORCH) <= gpu_memory(model, config, job, TORCH).total, config


def test_a_single_stage_is_counted_as_before_under_torch_stages():
    model, cluster, job = gpt_model(1024, 8, 16, 50304), Cluster(8, KINDS["H100-80GB"]), Job(16, 2048)
    for config in configurations(model, cluster, job, {}):
        if config.pp == 1:
            assert gpu_memory(model, config, job, TORCH) == gpu_memory(model, config, job, Software("bf16"))


def test_an_unknown_stages_value_is_one_line_and_exit_code_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pipeclock", "plan"])
    args = ["--cluster", "16xH100-80GB", "--model", "gpt", "--dim", "1024", "--layers", "8",
            "--pipelining", "torch"]  # fmt: skip
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "argument --pipelining: invalid choice: 'torch'" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(ValueError, match="unknown pipelining 'torch'"):
        Software(pipelining="torch")


@pytest.fixture(scope="module")
def table5() -> dict:
    """torchtitan's Table 5 (405B, 512 H100s, pp 8): published GiB, and the fullest rank's under
    pipeclock's stages and under torch's, as the planner chooses the configuration."""
    pytest.importorskip("transformers")
    from benchmarks.published_2024 import titan_rows
    from pipeclock.plan.search import search

    found = {}
    for row in titan_rows():
        if row.source == "torchtitan T5":
            best = search(row.model, row.cluster, row.job, row.software, row.fixed, top=1).ranked[0]
            own = gpu_memory(row.model, best.config, row.job, replace(row.software, pipelining="pipeclock"))
            found[row.name] = (row.memory * 2**30, own.total, best.memory.total)
    return found


def test_torch_stages_bring_table_5_within_ten_percent(table5):
    for published, _, torch_stages in table5.values():
        assert abs(torch_stages / published - 1) < 0.10
    published, own, torch_stages = table5["1F1B"]
    assert abs(own / published - 1) > 0.10 and torch_stages > own
