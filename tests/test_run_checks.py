"""A run refuses, in one line and before its first step, values that cannot work and ranks that disagree.

Ranks that disagree, and every other wrong usage that needs processes, are in tests/test_bad_input.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeclock.models.gpt import GPT, GPTConfig
from pipeclock.plan.memory_fit import (
    BATCH,
    STATIC,
    ModelTooLargeError,
    available,
    check_fits,
    estimate,
    rank_parameters,
)
from pipeclock.training.checks import _who_has_what
from pipeclock.training.loop import TrainConfig, unique_parameters
from pipeclock.training.tasks import RegressionTask


@pytest.mark.parametrize(
    "values, message",
    [
        ({"steps": 0}, "--steps must be a whole number >= 1, got 0"),
        ({"steps": -5}, "--steps must be a whole number >= 1, got -5"),
        ({"microbatches": 0}, "--microbatches must be a whole number >= 1, got 0"),
        ({"hidden": 0}, "--hidden must be a whole number >= 1, got 0"),
        ({"timeout": 0.0}, "--timeout must be > 0, got 0.0"),
        ({"timeout": -1.0}, "--timeout must be > 0, got -1.0"),
        ({"batch_size": 0}, "--batch-size must be a whole number >= 1, got 0"),
        ({"lr": 0.0}, "--lr must be > 0, got 0.0"),
        ({"dropout": 1.5}, "--dropout must be in [0, 1), got 1.5"),
    ],
)
def test_a_value_that_cannot_work_is_refused_by_the_config_itself(values, message):
    """A lab or a script builds a TrainConfig without the command line (which refuses these earlier)."""
    with pytest.raises(ValueError) as refused:
        TrainConfig(**values)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "fields, world",
    [
        (dict(hidden=8, layers=5), 2),
        (dict(hidden=8, layers=6, schedule="interleaved-1f1b"), 2),
        (dict(model="gpt", dim=16, heads=2, layers=3, seq_len=8, batch_size=4), 1),  # embedding and head tied
        (dict(model="gpt", dim=16, heads=2, layers=3, seq_len=8, batch_size=4), 2),
        (dict(model="gpt", dim=16, heads=2, layers=4, seq_len=8, batch_size=4, schedule="zb-v"), 2),
    ],
)
def test_the_memory_check_counts_each_ranks_parameters_as_building_its_stage_would(fields, world):
    config = TrainConfig(**fields)
    table = config.table(world)
    for rank in range(world):
        if config.model == "mlp":
            modules = RegressionTask(config).build(rank, world, table.placement)
        else:
            gpt = GPTConfig(dim=config.dim, layers=config.layers, heads=config.heads, seq_len=config.seq_len)
            modules = GPT.for_rank(gpt, rank, world, len(table.placement.stages[rank]), table.placement)
        built = sum(p.numel() for p in unique_parameters(modules))
        assert rank_parameters(config, table, rank) == built


def test_a_model_that_fits_only_split_is_accepted_at_tp2_and_refused_at_tp1():
    """At --tp 2 each rank holds half of every Linear: the check judges that half, as the planner does.

    The MLP is sized from this machine's memory: its weights, gradients and Adam state (16 bytes a
    parameter) come to 1.5 times what one rank may have, so only the split fits. Both runs are one stage
    (tp 1 on one process, tp 2 on two), so only tensor parallel halves the part.
    """
    room, _ = available(torch.device("cpu"))
    layers = 4
    hidden = math.isqrt(int(1.5 * room / 16 / layers))
    split, whole = (TrainConfig(hidden=hidden, layers=layers, batch_size=8, tp=tp) for tp in (2, 1))
    halves = estimate(split, split.table(1), 0)[STATIC], estimate(whole, whole.table(1), 0)[STATIC]
    assert halves[0] == pytest.approx(halves[1] / 2, rel=1e-6), halves
    check_fits(split, split.table(1), 0, torch.device("cpu"))  # accepted: no error
    with pytest.raises(ModelTooLargeError, match="does not fit on rank 0"):
        check_fits(whole, whole.table(1), 0, torch.device("cpu"))


def test_a_batch_of_token_ids_larger_than_the_machine_is_refused_naming_the_batch_size():
    """A language model's batch is counted too: a --batch-size whose token ids alone (inputs and targets,
    int64, this replica's rows) outgrow the machine is refused before any step, not killed by the OS."""
    room, _ = available(torch.device("cpu"))
    rows = room // (32 * 16) + 1  # a row holds 32 inputs and 32 targets of 8 bytes
    config = TrainConfig(model="gpt", dim=32, heads=2, layers=2, seq_len=32, batch_size=rows)
    assert estimate(config, config.table(1), 0)[BATCH] == rows * 32 * 16
    with pytest.raises(ModelTooLargeError, match="use a smaller --batch-size"):
        check_fits(config, config.table(1), 0, torch.device("cpu"))
    halved = TrainConfig(model="gpt", dim=32, heads=2, layers=2, seq_len=32, batch_size=rows, dp=2)
    assert estimate(halved, halved.table(1), 0)[BATCH] == math.ceil(rows / 2) * 32 * 16


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_memory_check_counts_each_ranks_one_ep_th_of_the_routed_experts(tmp_path, family):
    """Under --ep a rank holds 1/ep of each of its MoE layers' experts, whole over its dp replicas (FSDP2
    shards the rest over dp, not them): the check counts that share, measured on the built stages."""
    import warnings

    from pipeclock.models import hf
    from pipeclock.plan.rank_memory import Training
    from tests.test_expert_parallel import moe_config

    moe_config(family).save_pretrained(tmp_path)
    per_parameter = Training().bytes_per_parameter
    for world in (1, 2):
        layout = {dp: {ep: TrainConfig(model="hf", hf_config=str(tmp_path), dp=dp, ep=ep, batch_size=4,
                                       seq_len=8) for ep in (1, 2)} for dp in (2, 4)}  # fmt: skip
        table = layout[2][1].table(world)
        for rank in range(world):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built = hf.split(
                    hf.prepared_config(moe_config(family)), rank, world, chunks=1, placement=table.placement
                )
            experts = sum(p.numel() for n, p in built.named_parameters() if ".experts." in n)
            if family == "mixtral":  # (the paper model leaves out Qwen3's query and key norms)
                whole = sum(p.numel() for p in unique_parameters([built]))
                assert rank_parameters(layout[2][1], table, rank) == whole
            held = rank_parameters(layout[2][1], table, rank) - rank_parameters(layout[2][2], table, rank)
            assert held == experts // 2
            static = {dp: {ep: estimate(c, table, rank)[STATIC] for ep, c in row.items()}
                      for dp, row in layout.items()}  # fmt: skip
            assert static[2][2] == static[2][1]  # ep == dp divides the experts as FSDP2 would
            assert static[4][2] - static[4][1] == pytest.approx(
                experts * (1 / 2 - 1 / 4) * per_parameter, abs=1
            )


@pytest.mark.parametrize(
    "family, sizes",
    [
        ("gptj", dict(n_embd=32, n_layer=3, n_head=4, rotary_dim=4, vocab_size=300, n_positions=64)),
        ("gpt_bigcode", dict(n_embd=32, n_layer=3, n_head=4, vocab_size=300, n_positions=64)),  # tied head
    ],
)
def test_a_family_the_planner_does_not_read_is_counted_on_the_meta_device(tmp_path, family, sizes):
    """The paper model refuses these families, yet their runs are still checked before step 1: each
    rank's parameters are counted on the model built on the meta device, as building its stage holds."""
    import warnings

    from transformers import AutoConfig

    from pipeclock.models import hf
    from pipeclock.plan.hf_paper import paper_model, read_config

    AutoConfig.for_model(family, **sizes).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not read this family"):
        paper_model(read_config(tmp_path))
    for world in (1, 2):
        config = TrainConfig(model="hf", hf_config=str(tmp_path), layers=3, batch_size=4, seq_len=8)
        table = config.table(world)
        for rank in range(world):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = hf.prepared_config(read_config(tmp_path))
                built = hf.split(model, rank, world, placement=table.placement)
            assert rank_parameters(config, table, rank) == sum(p.numel() for p in unique_parameters([built]))


def test_ranks_that_disagree_are_grouped_by_value():
    assert _who_has_what("--layers", [8, 6, 8]) == "--layers is 8 on ranks 0, 2 and 6 on rank 1"
    assert _who_has_what("--data", ["a.txt", None]) == "--data is 'a.txt' on rank 0 and None on rank 1"


def test_checkpoint_options_without_a_checkpoint_directory_name_the_flags_given():
    from pipeclock.training.checkpointing import check_checkpointing

    with pytest.raises(ValueError) as refused:
        check_checkpointing(TrainConfig(checkpoint_every=5, keep_last=2))
    assert (
        str(refused.value)
        == "rank 0: --checkpoint-every and --keep-last need --checkpoint-dir (where the checkpoints go)"
    )
