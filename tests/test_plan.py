"""The planner: memory per rank and step time before any run, checked by hand and against a real run."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from pipeclock.cli.dispatch import main
from pipeclock.engine.actions import parse_schedule, placement_of
from pipeclock.engine.generators import generate, gpipe, one_f_one_b
from pipeclock.observe.simulate import Link
from pipeclock.observe.sizes import parse_bytes
from pipeclock.plan.model_layers import rough_layers
from pipeclock.plan.model_specs import mlp_spec
from pipeclock.plan.planner import cut_for, in_flight, judge, step_time
from pipeclock.plan.profile import profile
from pipeclock.plan.rank_memory import (
    Recompute,
    StageBytes,
    Training,
    activation_peak,
    rank_memory,
    stage_bytes,
    unmetered_peak,
    working_peak,
)
from tests.distributed import run_ok

MB_TENSOR = 16 * 1000 * 4  # one (16, 1000) fp32 activation


def layers(n=4, samples=16, params=1_000_000):
    """n rough layers of width 1000: each (16, 1000) tensor is 64 KB; F = 1, B = 2, I = W = 1."""
    return rough_layers(params * n, n, samples)


# --- sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("24GB", 24 * 10**9), ("24GiB", 24 * 2**30), ("512MB", 512 * 10**6), ("1.5tb", 1_500_000_000_000),
     ("64 KiB", 65536), ("7B", 7)],
)  # fmt: skip
def test_sizes_are_read_in_decimal_and_binary_units(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["24XB", "24", "GB", "24 G B"])
def test_a_size_without_a_known_unit_is_refused(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


# --- the memory model, by hand ------------------------------------------------------------------------


def test_a_stage_holds_its_input_each_inner_boundary_once_and_its_output():
    # 3 MLP layers: input, 2 inner boundaries (saved by a ReLU and the next Linear: counted once), output
    assert stage_bytes(layers()[:3]).forward == 4 * MB_TENSOR
    assert stage_bytes(layers()[:1]).forward == 2 * MB_TENSOR
    # bf16 halves the activations
    assert stage_bytes(layers()[:3], Training(dtype="bf16")).forward == 2 * MB_TENSOR


def test_full_recompute_keeps_the_stage_input_and_rebuilds_the_whole_stage_in_its_backward():
    full = stage_bytes(layers()[:3], Training(recompute=Recompute.parse("full")))
    assert full.forward == 2 * MB_TENSOR  # the stage's input (the checkpoint's too) and its output
    # during its backward the stage is rebuilt: its input and the two inner boundaries
    assert full.backward_extra == 3 * MB_TENSOR


def test_every_k_checkpoints_every_kth_layer_which_keeps_what_it_keeps_when_checkpointed():
    model = layers(6)
    assert stage_bytes(model, Training(recompute=Recompute.parse("every-2"))).forward == 7 * MB_TENSOR, (
        "an MLP layer keeps its input anyway, checkpointed or not (the ReLU after it keeps its output)"
    )
    # a block that saves three tensors inside, and only its input when checkpointed
    blocks = [replace(x, held=3 * MB_TENSOR, checkpointed=(0, MB_TENSOR, 0)) for x in model]
    none = stage_bytes(blocks)
    every2 = stage_bytes(blocks, Training(recompute=Recompute.parse("every-2")))
    assert none.forward - every2.forward == 3 * (3 * MB_TENSOR)  # layers 1, 3 and 5 drop their insides
    assert every2.backward_extra == 4 * MB_TENSOR  # one rebuilt block: its input and insides
    # what the meter misses (views' whole storages, the engine's captures) only outside checkpoints
    missed = [replace(x, unmetered=MB_TENSOR) for x in blocks]
    assert stage_bytes(missed).unmetered == 6 * MB_TENSOR
    assert stage_bytes(missed, Training(recompute=Recompute.parse("every-2"))).unmetered == 3 * MB_TENSOR
    assert stage_bytes(missed, Training(recompute=Recompute.parse("full"))).unmetered == 0
    assert [Recompute.parse("every-2").checkpointed(i) for i in range(4)] == [False, True, False, True]


def test_a_checkpointed_layer_keeps_for_w_what_its_rebuild_hands_over_and_never_less_than_without():
    model = layers(3)
    # a block whose W runs a LayerNorm again on the input its rebuild saw: more than without recompute
    blocks = [replace(x, weight_held=2 * MB_TENSOR, weight_held_checkpointed=3 * MB_TENSOR) for x in model]
    full = Training(recompute=Recompute.parse("full"))
    assert stage_bytes(blocks, full).weight_work == 9 * MB_TENSOR
    assert stage_bytes(blocks).weight_work == 6 * MB_TENSOR
    # the model's first layer, profiled alone, is rebuilt only in W; in a whole stage it is rebuilt in I
    first = [replace(model[0], weight_held=2 * MB_TENSOR, weight_held_checkpointed=MB_TENSOR), *blocks[1:]]
    assert stage_bytes(first, full).weight_work == 2 * MB_TENSOR + 6 * MB_TENSOR


def test_what_the_meter_misses_is_held_from_each_forward_to_its_backward():
    chunk = [StageBytes(forward=10, weight_work=0, backward_extra=0, loss=3, unmetered=1)]
    (rank,) = parse_schedule(["F0 F1 F2 B0 B1 B2"])
    assert unmetered_peak(rank, chunk) == 12
    (split,) = parse_schedule(["F0 I0 F1 W0 I1 W1"])
    assert unmetered_peak(split, chunk, keeps_graph=True) == 5  # F1 after I0: 1 (W0 needs the graph) + 4
    assert unmetered_peak(split, chunk, keeps_graph=False) == 4  # the loss's backward is part of I


def test_an_actions_working_memory_comes_on_top_of_what_was_held_when_it_ran():
    # full recompute: F keeps 2, the backward rebuilds 8 more; W needs 5 (out of the rebuild)
    chunk = [StageBytes(forward=2, weight_work=5, backward_extra=8, workspace=1)]
    (whole,) = parse_schedule(["F0 F1 B0 B1"])
    assert working_peak(whole, chunk) == 2 + 2 + 8 + 1  # B0 rebuilds while both forwards are held
    (split,) = parse_schedule(["F0 F1 I0 I1 W0 W1"])
    # I1 rebuilds while I0's 5 for W and its own 2 are held; its own 5 for W come out of the rebuild
    assert working_peak(split, chunk, keeps_graph=False) == 5 + 2 + 8 + 1
    assert activation_peak(split, chunk, keeps_graph=False) == 10


def test_the_activation_peak_follows_the_ranks_own_order_of_actions():
    chunk = [StageBytes(forward=10, weight_work=4, backward_extra=0)]
    (rank,) = parse_schedule(["F0 F1 B0 F2 B1 B2"])
    assert activation_peak(rank, chunk) == 20
    (split,) = parse_schedule(["F0 I0 F1 W0 I1 W1"])
    assert activation_peak(split, chunk, keeps_graph=False) == 14  # after I0 only W's 4 bytes stay
    assert activation_peak(split, chunk, keeps_graph=True) == 24  # the graph stays too: 14 + 10
    # of W's 4 bytes, 3 are tensors the forward already keeps (a Linear's input): counted once
    once = [replace(chunk[0], weight_beyond=1)]
    assert activation_peak(split, once, keeps_graph=True) == 21 and activation_peak(split, once, False) == 14


def test_rank_memory_adds_weights_gradients_adam_state_activations_and_message_buffers():
    model = [replace(layer, largest_parameter=4 * 1000 * 1000) for layer in layers(4)]  # unfused Adam
    table = one_f_one_b(2, 4)
    cut = [range(0, 2), range(2, 4)]
    first, last = rank_memory(model, cut, table)
    params = 2 * 1000 * 1000  # two bias-free layers
    assert (first.parameters, first.gradients, first.optimizer) == (4 * params, 4 * params, 8 * params)
    # rank 0 of 1F1B on two stages holds two micro-batches of (input, boundary, output)
    assert first.activations == 2 * 3 * MB_TENSOR
    assert last.activations == 1 * 3 * MB_TENSOR
    assert first.messages == MB_TENSOR and last.messages == MB_TENSOR  # a gradient in / an activation in
    # workspace: a backward's input gradient (the rough layers' temporary); no loss kept (MSE keeps none)
    assert first.workspace == MB_TENSOR and last.workspace == MB_TENSOR
    # Adam's update of the largest tensor needs two copies of it, after the activations are freed
    assert first.optimizer_step == 2 * 4 * 1000 * 1000
    static = first.parameters + first.gradients + first.optimizer
    assert first.total == static + max(first.activations + first.messages + first.workspace, 8_000_000)
    sgd = rank_memory(model, cut, table, Training(optimizer="sgd"))[0]
    assert sgd.optimizer == 0 and sgd.optimizer_step == 0
    assert sgd.total == 8 * params + sgd.activations + sgd.messages + sgd.workspace


def test_the_step_time_is_the_simulator_fed_with_each_stages_own_costs():
    model = layers(3)
    cut = [range(0, 2), range(2, 3)]  # stage 0: F = 2, B = 4; stage 1: F = 1, B = 2
    timeline = step_time(model, cut, gpipe(2, 1))
    # F0 on rank 0 (0-2), F0 on rank 1 (2-3), B0 on rank 1 (3-5), B0 on rank 0 (5-9)
    assert timeline.makespan == 9
    recomputed = step_time(model, cut, gpipe(2, 1), Training(recompute=Recompute.parse("full")))
    assert recomputed.makespan == 9 + 1 + 2  # each backward runs its stage's forward again
    # the engine's own time per action lengthens each of the four on the critical path alike
    assert step_time(model, cut, gpipe(2, 1), action_overhead=0.5).makespan == 9 + 4 * 0.5


def test_the_step_time_charges_each_message_the_links_latency_and_its_bytes():
    model = layers(3)  # each layer hands on a (16, 1000) float32 tensor: 64 KB
    cut = [range(0, 2), range(2, 3)]
    free = step_time(model, cut, gpipe(2, 1)).makespan
    slow = step_time(model, cut, gpipe(2, 1), link=Link(latency=0.25, bandwidth=64_000 / 0.5))
    assert slow.makespan == free + 2 * (0.25 + 0.5)  # one activation, one gradient, each 64 KB


def test_judging_a_configuration_cuts_sizes_and_simulates_it():
    plan = judge(layers(4), "1f1b", 2, 4)
    assert [len(part) for part in plan.cut] == [2, 2]
    assert plan.step_time == pytest.approx(simulated_1f1b_makespan := 3 * 2 * (4 + 2 - 1))
    assert simulated_1f1b_makespan == 30 and plan.peak == max(m.total for m in plan.memory)


def test_what_the_engine_holds_whatever_the_model_is_added_to_every_rank():
    bare, held = judge(layers(4), "1f1b", 2, 4), judge(layers(4), "1f1b", 2, 4, runtime_memory=10**6)
    assert [m.total + 10**6 for m in bare.memory] == [m.total for m in held.memory]
    assert "runtime" not in bare.memory[0].parts and held.memory[1].parts["runtime"] == 10**6


def test_a_cut_by_memory_gives_fewer_layers_to_the_stage_that_holds_more_micro_batches():
    # 1F1B on two stages: stage 0 holds two micro-batches, stage 1 one; activations outweigh weights
    model = rough_layers(4 * 10_000, 4, samples=1000)  # width 100: 160 KB of state, 400 KB tensors
    table = one_f_one_b(2, 4)
    assert in_flight(table) == [2, 1]
    by_memory = cut_for(model, 2, "memory", table=table)
    assert by_memory == [range(0, 1), range(1, 4)]
    peak = lambda cut: max(rank.total for rank in rank_memory(model, cut, table))  # noqa: E731
    assert peak(by_memory) < peak(cut_for(model, 2, "layers"))


# --- the command --------------------------------------------------------------------------------------


def plan_command(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["pipeclock", "plan"])
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_course_question_is_answered_with_its_reasoning(monkeypatch, capsys):
    code, out, err = plan_command(
        monkeypatch, capsys, "--params", "10e9", "--device-memory", "24GB", "--dtype", "fp32",
        "--stages", "6,7,8", "--microbatches", "8",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert "10B x 16 B = 160 GB to train; ceil(160 GB / 24 GB) = 7 devices at the very least" in out
    assert "7 stages: the fullest rank holds 3 layers = 30 GB" in out and "does not fit" in out
    assert "answer: 8 stages (8 devices of 24 GB)" in out
    assert "rank  7 |" in out and "rank  8 |" not in out
    # the engine's own memory on every rank (a GPU's context, say) can tip the answer
    code, out, _ = plan_command(
        monkeypatch, capsys, "--params", "10e9", "--stages", "8,16", "--microbatches", "8",
        "--runtime-memory", "4GB",
    )  # fmt: skip
    assert code == 0 and "+ 4 GB runtime" in out and "answer: 16 stages" in out


def test_an_hf_config_is_planned_each_rank_holding_the_parameters_its_split_holds(
    monkeypatch, capsys, tmp_path
):
    """GPT-2 (a tied head) from its config.json: the command plans it, and the planner's parameters per
    stage are those ``hf.split`` gives each rank, the head's copy of the tied matrix included."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config

    from pipeclock.models import hf
    from pipeclock.models.partition import partition
    from pipeclock.plan.model_specs import hf_spec

    config = GPT2Config(
        n_embd=16, n_layer=4, n_head=2, vocab_size=1000, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    config.save_pretrained(str(tmp_path))
    code, out, err = plan_command(
        monkeypatch, capsys, "--model", "hf", "--hf-config", str(tmp_path), "--seq-len", "16",
        "--batch-size", "4", "--stages", "2,3", "--microbatches", "2", "--schedules", "1f1b",
        "--recompute", "none", "--device-memory", "1GB",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert "gpt2 4 layers x 16 (vocab 1,000)" in out and "answer: 2 stages" in out
    pieces = profile(hf_spec(config, 16), samples=2, repeats=1, warmup=0)
    assert [layer.name for layer in pieces[:2]] == ["transformer.wte", "transformer.h.0"]
    for stages in (2, 3):
        for rank, part in enumerate(partition(len(pieces), stages)):
            split = sum(p.numel() for p in hf.split(config, rank, stages).parameters())
            assert sum(pieces[i].parameters for i in part) == split, (stages, rank)
    # where one rank holds both ends it holds the tied matrix once: one stage, or V's first and last
    for name, stages, chunks in (("1f1b", 1, 1), ("zb-v", 2, 2)):
        planned = judge(pieces, name, stages, 2, simulated=False).memory
        for rank in range(stages):
            built = hf.split(config, rank, stages, chunks=chunks, placement="v" if chunks > 1 else "loop")
            held = {id(p): p.numel() for c in (built if chunks > 1 else [built]) for p in c.parameters()}
            assert planned[rank].parameters == 4 * sum(held.values()), (name, rank)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "hf"], "--model hf needs --hf-config PATH"),
        (["--model", "hf", "--hf-config", "config.json", "--layers", "4"], "--layers does not apply"),
        (["--model", "hf", "--hf-config", "/nowhere/config.json"], "no Hugging Face config at"),
        (["--params", "10e9", "--device-memory", "24XB"], "unknown unit 'XB'"),
        (["--params", "10e9", "--device-memory", "512MB"], "one layer alone needs 10 GB to train"),
        (["--params", "10e9", "--stages", "20"], "more than the model's 16 layers"),
        (["--params", "ten"], "--params takes a number"),
        (["--params", "1e6", "--schedules", "2f2b"], "unknown schedule '2f2b'"),
        (["--params", "1e6", "--recompute", "some"], "unknown recompute 'some'"),
        (["--params", "1e6", "--action-overhead", "1"], "--action-overhead needs a measured model"),
        (["--params", "1e6", "--link-latency", "500"], "--link-latency needs a measured model"),
        (["--params", "1e6", "--runtime-memory", "2XB"], "unknown unit 'XB'"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(monkeypatch, capsys, args, message):
    code, out, err = plan_command(monkeypatch, capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("pipeclock plan: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_tensor_parallel_splits_each_layer_and_charges_its_all_reduces_on_the_link():
    from pipeclock.plan.tensor_parallel import MLP, TRANSFORMER, split_layers

    link = Link(latency=1e-4, bandwidth=1e9)
    whole = layers(4)[:3]  # three of kind "layer", charged as transformer blocks here
    split = split_layers(whole, 2, TRANSFORMER, link)
    all_reduce = 2 * (2 - 1) / 2 * MB_TENSOR / 1e9 + 1e-4  # one all-reduce of a layer's output, 2 ranks
    for a, b in zip(whole, split, strict=True):
        assert b.parameters == a.parameters // 2 and b.held == a.held // 2
        assert b.keeps_input == a.keeps_input and b.message_bytes == a.message_bytes  # whole on each rank
        assert b.forward == pytest.approx(a.forward / 2 + 2 * all_reduce)  # four per layer: two each way
        assert b.input_grad == pytest.approx(a.input_grad / 2 + 2 * all_reduce)
        assert b.weight_grad == pytest.approx(a.weight_grad / 2)
    pair = split_layers(whole, 2, MLP, link)[0]  # a Linear pair all-reduces once each way
    assert pair.forward == pytest.approx(whole[0].forward / 2 + all_reduce / 2)
    sequence = split_layers(whole, 2, TRANSFORMER, link, sequence_parallel=True)[0]
    assert sequence.message_bytes == MB_TENSOR // 2  # split over the tokens too
    assert sequence.forward == pytest.approx(
        whole[0].forward / 2 + 2 * (all_reduce + 1e-4)
    )  # twice the calls
    plain, halved = judge(whole, "1f1b", 2, 4, simulated=False), judge(split, "1f1b", 2, 4, simulated=False)
    assert [r.parameters for r in halved.memory] == [r.parameters // 2 for r in plain.memory]


def test_the_command_plans_tensor_parallel_ranks_and_refuses_a_split_of_a_head(monkeypatch, capsys):
    code, out, err = plan_command(
        monkeypatch, capsys, "--params", "10e9", "--tp", "2", "--stages", "4", "--microbatches", "8",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert "tensor parallel 2: each stage's layers split over 2 ranks" in out
    assert "answer: 4 stages x tp 2 (8 devices of 24 GB)" in out
    code, out, err = plan_command(monkeypatch, capsys, "--model", "gpt", "--heads", "4", "--tp", "3")
    assert code == 2 and "--tp 3 does not divide the model's 4 attention heads" in err


# --- against a real run -------------------------------------------------------------------------------


SCHEDULES_MEASURED = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def _measured_peaks(rank, world, m, batch):
    return {name: _measured_peak(rank, world, name, m, batch) for name in SCHEDULES_MEASURED}


def _measured_peak(rank, world, schedule, m, batch):
    from pipeclock.engine.orchestrator import Pipeline
    from pipeclock.models.mlp import ShardedMLP

    chunks = 2 if schedule == "interleaved-1f1b" else 1
    table = generate(schedule, world, m, chunks)
    modules = ShardedMLP.for_rank(128, 8, rank, world, chunks, placement=placement_of(table))
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (
        torch.randn(batch, 128, generator=generator),
        torch.randn(batch, 128, generator=generator),
    )
    pipe = Pipeline(modules, table, m, F.mse_loss)
    pipe.step(inputs, targets)
    return pipe.last.peak_activation_bytes


@pytest.mark.slow
def test_the_predicted_activation_peak_is_what_the_meter_measures_in_a_real_run():
    torch.set_num_threads(1)
    model = profile(mlp_spec(128, 8), samples=8, repeats=1, warmup=0)
    per_rank = run_ok(_measured_peaks, 2, 4, 32)
    for schedule in SCHEDULES_MEASURED:
        measured = [peaks[schedule] for peaks in per_rank]
        predicted = [rank.activations for rank in judge(model, schedule, 2, 4, simulated=False).memory]
        assert predicted == pytest.approx(measured, rel=0.10), schedule


RECOMPUTE_MEASURED = ("none", "every-2", "full")
GPT_PLANNED = dict(dim=32, layers=4, heads=2, seq_len=16, dropout=0.0, seed=1)


def _gpt_peaks(rank, world, m, batch):
    from pipeclock.engine.losses import TokenCrossEntropy
    from pipeclock.engine.orchestrator import Pipeline
    from pipeclock.models.gpt import GPT, GPTConfig

    config = GPTConfig(**GPT_PLANNED)
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=torch.Generator())
    peaks = {}
    for schedule in ("1f1b", "zb-h1"):
        for policy in RECOMPUTE_MEASURED:
            chunks = GPT.for_rank(config, rank, world)
            pipe = Pipeline(chunks, schedule, m, TokenCrossEntropy(), recompute=policy)
            pipe.step(ids[:, :-1], ids[:, 1:])
            peaks[schedule, policy] = pipe.last.peak_activation_bytes
        pipe = Pipeline(GPT.for_rank(config, rank, world), schedule, m, TokenCrossEntropy(), dtype="bf16")
        pipe.step(ids[:, :-1], ids[:, 1:])
        peaks[schedule, "bf16"] = pipe.last.peak_activation_bytes
    return peaks


@pytest.mark.slow
def test_recompute_and_bf16_lower_the_measured_peak_on_a_gpt_as_the_planner_predicts():
    from pipeclock.models.gpt import GPTConfig
    from pipeclock.plan.model_specs import gpt_spec

    torch.set_num_threads(1)
    m, batch = 4, 8
    spec = gpt_spec(GPTConfig(**GPT_PLANNED))
    model = profile(spec, samples=batch // m, repeats=1, warmup=0)
    in_bf16 = profile(spec, samples=batch // m, repeats=1, warmup=0, dtype="bf16")
    per_rank = run_ok(_gpt_peaks, 2, m, batch)
    for schedule in ("1f1b", "zb-h1"):
        for policy in RECOMPUTE_MEASURED:
            training = Training(recompute=Recompute.parse(policy))
            plan = judge(model, schedule, 2, m, training, simulated=False)
            predicted = [rank.activations for rank in plan.memory]
            measured = [peaks[schedule, policy] for peaks in per_rank]
            assert predicted == pytest.approx(measured, rel=0.10), (schedule, policy)
        rank0 = per_rank[0]
        assert rank0[schedule, "full"] < rank0[schedule, "every-2"] < rank0[schedule, "none"]
        # bf16: what autocast saves, measured by a profile under autocast (not half of float32's)
        plan = judge(in_bf16, schedule, 2, m, Training(dtype="bf16"), simulated=False)
        measured = [peaks[schedule, "bf16"] for peaks in per_rank]
        assert [rank.activations for rank in plan.memory] == pytest.approx(measured, rel=0.10), schedule
        assert all(peaks[schedule, "bf16"] < peaks[schedule, "none"] for peaks in per_rank)


def test_a_measured_model_is_planned_and_its_memory_drawn(monkeypatch, capsys, tmp_path):
    png = tmp_path / "memory.png"
    code, out, err = plan_command(
        monkeypatch, capsys, "--model", "mlp", "--hidden", "64", "--layers", "4", "--batch-size", "16",
        "--device-memory", "200KiB", "--stages", "1,2", "--microbatches", "4", "--png", str(png),
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert "ShardedMLP 4 x 64 (layers measured here" in out and "step time in ms" in out
    assert "answer: 2 stages" in out  # 4 layers x 65 KiB of weights, gradients and Adam state > 200 KiB
    assert png.read_bytes()[:4] == b"\x89PNG"
