"""Context parallel in the cluster planner (`pipeclock.plan.context_parallel`): a cp rank holds 1/cp of
every activation, moves the keys and values its implementation moves, shares its states' sharding with
the data-parallel ranks, and cp=1 leaves every figure as it was."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from pipeclock.cli.dispatch import main
from pipeclock.plan import calibration, context_parallel
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import gpu_memory
from pipeclock.plan.cluster_plan import predict
from pipeclock.plan.cluster_time import Rates, layer_time
from pipeclock.plan.gpus import KINDS, Cluster
from pipeclock.plan.paper_model import PaperModel, gpt_model, mlp_model
from pipeclock.plan.search import SearchError, config_groups, search

H100 = KINDS["H100-80GB"]
GPT = gpt_model(2048, 24, 16, 50304)
# a Llama-shaped model with grouped-query attention: 32 query heads, 8 key/value heads of 128
GQA = PaperModel("GQA 24 x 4096", 24, 4096, 32, 8, 128, 14336, 128256)


def config(cp: int, dp: int = 2, **changes) -> Config:
    base = Config(1, 1, dp, "1f1b", 1, 1, 2, "none", 1, False, cp=cp)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("recompute", ["none", "selective-op", "full"])
def test_a_cp_rank_keeps_one_cp_th_of_the_activations(recompute):
    job, software = Job(4, 16384), Software("bf16", fused=True)
    whole = gpu_memory(GQA, config(1, recompute=recompute), job, software).activations
    for cp in (2, 4, 8):
        split = gpu_memory(GQA, config(cp, recompute=recompute), job, software).activations
        assert split == pytest.approx(whole / cp, rel=1e-12)


def test_the_states_shard_over_dp_x_cp_as_over_the_same_count_of_data_parallel_ranks():
    job, software = Job(8, 8192), Software("bf16")
    for zero in (1, 2, 3):
        split = gpu_memory(GQA, config(4, dp=2, zero=zero), job, software)
        plain = gpu_memory(GQA, config(1, dp=8, zero=zero), job, software)
        assert (split.gradients, split.optimizer) == (plain.gradients, plain.optimizer)


def test_the_layers_work_is_one_cp_th_and_the_exchange_is_what_the_implementation_moves():
    """Products, attention and elementwise work split evenly (load-balanced chunks; each rank still reads
    the whole weights); an all-gather left in the critical path adds (cp - 1) blocks of keys and values on
    the link, where a ring, each step hidden behind its block's attention, adds nothing to the forward."""
    job, a = Job(2, 65536), 2
    exposed = Software("bf16", fused=True, cp_exchange="all-gather-exposed")
    hidden = Software("bf16", fused=True, cp_exchange="ring")
    whole = layer_time(GQA, config(1), job, exposed, Rates(H100, exposed))
    for cp in (2, 8):
        split = layer_time(GQA, config(cp), job, exposed, Rates(H100, exposed))
        block = 65536 / cp * 2 * GQA.kv_dim * a  # a rank's keys and values of one sequence (mbs 1)
        link = H100.intra_node_bandwidth * calibration.LINK_EFFICIENCY  # cp x tp within the node
        gathered = (cp - 1) * block / link + calibration.COLLECTIVE_LATENCY
        assert context_parallel.block_bytes(GQA, config(cp), job, exposed) == block
        under = layer_time(GQA, config(cp), job, hidden, Rates(H100, hidden))
        assert split.forward - under.forward == pytest.approx(gathered, rel=1e-9)
        assert under.forward == pytest.approx(whole.forward / cp, rel=0.03)  # the weights' reads whole
        assert split.weight_grad == pytest.approx(whole.weight_grad / cp, rel=0.03)


def test_torchs_all_gather_hides_behind_the_local_block_and_a_ring_behind_each_step():
    """What is left: torch's merges in fp32 and its last gradients' send; a ring's last gradients' send."""
    job = Job(1, 131072)
    attention = 0.2  # seconds of one layer's forward attention on a rank: far more than the exchange
    hidden = [
        context_parallel.exchange(GQA, config(4), job, Software("bf16", cp_exchange=method), H100, attention)
        for method in ("all-gather", "ring")
    ]
    block = context_parallel.block_bytes(GQA, config(4), job, Software("bf16"))
    link = H100.intra_node_bandwidth * calibration.LINK_EFFICIENCY
    gradients = block * 2 / link + calibration.COLLECTIVE_LATENCY  # torch's fp32 gradients: the last send
    send = block / link + calibration.COLLECTIVE_LATENCY
    merges = context_parallel.merge_seconds(GQA, config(4), job, Software("bf16"), H100)
    assert hidden[0] == context_parallel.Exchange(
        pytest.approx(merges[0]), pytest.approx(gradients + merges[1])
    )
    assert hidden[1] == context_parallel.Exchange(0.0, pytest.approx(send))
    # past a node (tp 8 x cp 4), on each GPU's network share; keys and values repeated to the query width
    wide = config(4, tp=8)
    repeated = Software("bf16", cp_exchange="all-gather-exposed", repeat_kv=True)
    far = context_parallel.exchange(GQA, wide, job, repeated, H100, attention)
    moved = 3 * 131072 / 4 * 2 * GQA.q_dim / 8 * 2
    network = H100.inter_node_bandwidth * calibration.LINK_EFFICIENCY
    assert far.forward == pytest.approx(moved / network + calibration.COLLECTIVE_LATENCY)


# three configurations without context parallel: (layout knobs, job, software)
WITHOUT_CP = [
    ((2, 4, 4, "interleaved-1f1b", 2, 1, 8, "selective-op", 1, True), (32, 4096), ("bf16", True, True)),
    ((1, 1, 8, "1f1b", 1, 2, 2, "full", 3, False), (32, 8192), ("fp8", True)),
    ((8, 2, 2, "zb-v", 2, 1, 16, "none", 2, True), (32, 2048), ("bf16",)),
]  # fmt: skip


@pytest.mark.parametrize(("knobs", "job", "software"), WITHOUT_CP)
def test_at_cp_1_how_keys_and_values_would_be_exchanged_changes_nothing(knobs, job, software):
    chosen = Config(*knobs)
    assert chosen.cp == 1 and chosen.replicas == chosen.dp
    figures = set()
    for exchange in ("all-gather", "ring", "all-gather-exposed"):
        p = predict(
            GPT, chosen, Job(*job), Software(*software, cp_exchange=exchange), Cluster(chosen.gpus, H100)
        )
        figures.add((p.time.step, p.memory.total))
    assert len(figures) == 1


def test_the_search_tries_cp_for_long_sequences_or_when_asked_and_lays_cp_next_to_tp():
    def tried(seq: int, fixed: dict | None = None) -> set[int]:
        return {base.cp for base, _ in config_groups(GQA, Cluster(16, H100), Job(16, seq), fixed or {})}

    assert tried(16384) == {1} and tried(16384, {"cp": 4}) == {4}
    assert tried(32768) == {1, 2, 4, 8, 16} and tried(32768 + 8) == {1, 2, 4}  # 2 x cp chunks must split it
    assert tried(65536, {"tp": 8, "dp": 1}) == {1, 2}
    job, software = Job(16, 32768), Software("bf16", fused=True)
    fixed = search(GQA, Cluster(16, H100), job, software, {"cp": 2, "tp": 4, "pp": 1}, top=1).ranked[0]
    assert (fixed.config.cp, fixed.config.dp, fixed.config.gpus) == (2, 2, 16)
    assert " x cp 2 x pp 1 x dp 2, " in fixed.config.label()


@pytest.mark.parametrize(
    ("fixed", "message"),
    [
        ({"cp": 3}, "--fix cp = 3 does not divide the cluster's 16 GPUs"),
        ({"cp": 16, "tp": 2}, "--fix tpxcp = 32 does not divide the cluster's 16 GPUs"),
        (
            {"cp": 2, "tp": 2, "pp": 2, "dp": 4},
            "--fix tp x cp x pp x dp = 2 x 2 x 2 x 4 = 32, not the cluster's",
        ),
    ],
)
def test_a_cp_that_cannot_lay_out_is_refused_naming_it(fixed, message):
    with pytest.raises(SearchError) as refused:
        search(GQA, Cluster(16, H100), Job(16, 4096), Software("bf16"), fixed)
    assert message in str(refused.value)


def test_a_cp_whose_chunks_do_not_split_the_sequence_evenly_is_refused():
    with pytest.raises(SearchError, match=r"--fix cp=4: --seq-len 4100 does not split into 2 x cp = 8"):
        search(GQA, Cluster(16, H100), Job(16, 4100), Software("bf16"), {"cp": 4})
    mlp = mlp_model(10**9, 4)
    with pytest.raises(SearchError, match="context parallel splits attention's sequence"):
        search(mlp, Cluster(16, H100), Job(16, 4096), Software("bf16"), {"cp": 2})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fix", "cp=0"], "--fix cp=0 must be >= 1"),
        (["--fix", "cp=two"], "--fix cp=two: a whole number is needed"),
        (["--fix", "cp=3"], "--fix cp = 3 does not divide the cluster's 16 GPUs"),
        (["--cp-exchange", "scatter"], "argument --cp-exchange: invalid choice: 'scatter'"),
    ],
)
def test_a_bad_cp_on_the_command_line_is_one_line_and_exit_code_2(monkeypatch, capsys, args, message):
    monkeypatch.setattr(sys, "argv", ["pipeclock", "plan"])
    code = main(
        ["plan", "--cluster", "16xH100-80GB", "--model", "gpt", "--dim", "1024", "--layers", "8", *args]
    )
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_fix_cp_judges_one_configuration_and_its_json_names_cp(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pipeclock", "plan"])
    args = ["--cluster", "16xH100-80GB", "--model", "gpt", "--dim", "1024", "--layers", "8", "--seq-len",
            "8192", "--global-batch", "16", "--fix", "cp=4", "--cp-exchange", "ring", "--json"]  # fmt: skip
    code = main(["plan", *args])
    out, _ = capsys.readouterr()
    chosen = json.loads(out)
    assert code == 0 and chosen["cp"] == 4 and chosen["tp"] * chosen["pp"] * chosen["dp"] * 4 == 16
