"""Tensor parallel inside a stage: tp ranks share each stage, and the step is still one device's.

On every layout (dp x pp x tp) and schedule tried, one step of the MLP, the GPT (tied embedding, padded
token targets, dropout) and a Hugging Face Llama (grouped-query attention; untied, and tied) split by
their own plans leaves the loss, every gradient (each split gradient gathered whole) and the gradient
norm within 1e-5 relative of the whole model's on one process for the whole batch. Every schedule runs
at tp 2 x pp 2. A bad plan is one line on every rank, before anything is split; so are tp ranks given
different batches, before the step. The time inside tp's collectives is theirs alone. The cases are
``tests/tp_cases.py``; the main job at tp 2 is ``tests/test_tp_training.py``.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from pipeclock import comms, parallel, schedule
from pipeclock.engine import program
from pipeclock.engine.generators import generate
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.orchestrator import BatchRefused
from pipeclock.models import gpt, mlp
from pipeclock.observe.collectives import timing_collectives
from pipeclock.parallel.mesh import mesh_layout, pipelines
from tests.cases import SCHEDULE_CHUNKS
from tests.distributed import run_ok
from tests.hf_cases import llama_config
from tests.tp_cases import (
    CALLS_PER_MICROBATCH,
    GPT_CONFIG,
    MLP_LAYERS,
    MLP_WIDTH,
    TOLERANCE,
    built,
    layouts,
    my_shard,
    pipeline,
    token_batch,
)


def refusals(rank: int, world: int) -> dict[str, tuple[str, bool]]:
    """What each bad plan or layout raises on this rank, and whether anything was split before it."""
    from pipeclock.models import hf
    from tests.hf_cases import gpt2_config

    mesh = parallel.init_mesh(1, world)
    config = gpt.GPTConfig(**GPT_CONFIG)

    def attempt(make_plan, chunks=None) -> tuple[str, bool]:
        chunks = chunks or gpt.GPT.for_rank(config, 0, 1)
        try:
            parallel.tensor_parallel(chunks, mesh, make_plan(), "--tp-plan bad.json")
            return "accepted", True
        except ValueError as error:
            split = any(hasattr(p, "placements") for c in chunks for p in c.parameters())
            return str(error), split

    narrow = gpt.GPTConfig(**{**GPT_CONFIG, "vocab_size": 255})
    three_heads = gpt.GPTConfig(**{**GPT_CONFIG, "dim": 12, "heads": 3})
    llama = llama_config(layers=2)
    llama.num_key_value_heads = 1
    gpt2 = gpt2_config(layers=2)
    return {
        "absent module": attempt(lambda: {"h0.attn.q": "colwise", "h*.attn.qkv": "colwise"}),
        "unknown style": attempt(lambda: {"h0.attn.q": "packed_colwise"}),
        "not a Linear": attempt(lambda: {"h0.ln1": "colwise"}),
        "tie split at one end": attempt(lambda: {"embed.wte": "embedding_rowwise"}),
        "width": attempt(lambda: {"layers.0": "colwise"}, mlp.ShardedMLP.for_rank(15, 2, 0, 1)),
        "mlp width": attempt(lambda: mlp.tp_plan(15, [range(2)], world)),
        "heads": attempt(lambda: gpt.tp_plan(three_heads, world)),
        "vocabulary": attempt(lambda: gpt.tp_plan(narrow, world)),
        "no hf plan": attempt(lambda: hf.tp_plan(gpt2_config(), world)),
        "key/value heads": attempt(lambda: hf.tp_plan(llama, world)),
        "ddp": _ddp_refusal(mesh, config),
        "a given plan for an HF model": attempt(
            lambda: hf.tp_plan(gpt2, world, {"h.*.mlp.c_fc": "colwise"}), [hf.split(gpt2, 0, 1)]
        ),
    }


def _ddp_refusal(mesh, config) -> tuple[str, bool]:
    chunks = parallel.tensor_parallel(gpt.GPT.for_rank(config, 0, 1), mesh, gpt.tp_plan(config, 2))
    try:
        parallel.data_parallel(chunks, mesh, "ddp")
        return "accepted", True
    except ValueError as error:
        return str(error), False


TP2 = [(1, 2, [("mlp", "1f1b", 3), ("gpt", "gpipe", 3), ("llama", "1f1b", 2), ("llama-tied", "zb-h1", 3)])]


def on_two_ranks(rank: int, world: int) -> tuple[dict, dict]:
    return layouts(rank, world, TP2), refusals(rank, world)


@pytest.fixture(scope="module")
def two_ranks() -> list[tuple[dict, dict]]:
    """One launch of two processes for both tests at tp 2 (starting processes is the slow part)."""
    return run_ok(on_two_ranks, 2, deadline=600)


def test_a_bad_plan_or_layout_is_one_line_on_every_rank_before_anything_is_split(two_ranks):
    expected = {
        "absent module": "--tp-plan bad.json names h*.attn.qkv, which the model does not have",
        "unknown style": "--tp-plan bad.json asks for 'packed_colwise' at h0.attn.q, which pipeclock",
        "not a Linear": "--tp-plan bad.json splits h0.ln1 (colwise), a LayerNorm: only nn.Linear and",
        "tie split at one end": "splits the tied weight embed.wte.weight differently where it is used",
        "width": "--tp 2 does not divide the 15 output features of layers.0 (colwise splits them)",
        "mlp width": "--tp 2 does not divide the MLP's width 15 (--hidden)",
        "heads": "--tp 2 does not divide the GPT's 3 attention heads (--heads)",
        "vocabulary": "--tp 2 does not divide the GPT's vocabulary of 255",
        "no hf plan": "GPT2Config has no tensor-parallel plan (its base_model_tp_plan is empty): give one "
        "with --tp-plan FILE",
        "key/value heads": "--tp 2 does not divide the model's 1 key/value heads",
        "ddp": "DDP cannot hold tensor-parallel parameters",
        "a given plan for an HF model": "splits transformer.h.0.mlp.c_fc (colwise), a Conv1D: only nn.Linear",
    }
    for rank, (_, found) in enumerate(two_ranks):
        for case, (message, split) in found.items():
            assert expected[case] in message and "\n" not in message and not split, (rank, case, message)
            if case in (
                "absent module",
                "unknown style",
                "not a Linear",
                "tie split at one end",
                "width",
                "ddp",
            ):
                assert message.startswith(f"rank {rank}: "), message


def check(world: int, runs, per_rank=None) -> None:
    per_rank = per_rank or run_ok(layouts, world, runs, deadline=600)
    assert len(per_rank[0]) == sum(len(cases) for _, _, cases in runs)
    worst = {case: {k: max(r[case][k] for r in per_rank) for k in per_rank[0][case]} for case in per_rank[0]}
    bad = {
        case: found
        for case, found in worst.items()
        if any(v > TOLERANCE for k, v in found.items() if k != "dropout changed the loss")
        or found.get("dropout changed the loss", 1.0) != 1.0
    }
    assert not bad, f"(dp, pp, tp) steps differ from one process in {len(bad)} of {len(worst)} cases: {bad}"


def test_tp2_gives_the_one_process_loss_gradients_and_norm_for_the_mlp_the_gpt_and_llama(two_ranks):
    check(2, TP2, [found for found, _ in two_ranks])


def different_batches(rank: int, world: int) -> dict[str, str | float]:
    """At pp 2 x tp 2: a step whose tp ranks were given different inputs (the same samples, in another
    order), one whose last stage's tp ranks were given different targets, then a step of one batch:
    what each raised on this rank, and the last one's loss. The tp group is found from the chunks."""
    mesh = parallel.init_mesh(1, 2)
    pp, tp = mesh["pp"].size(), parallel.tp_rank(mesh)
    chunks = mlp.ShardedMLP.for_rank(MLP_WIDTH, MLP_LAYERS, parallel.pp_rank(mesh), pp, seed=3)
    parallel.tensor_parallel(chunks, mesh, mlp.tp_plan(MLP_WIDTH, mlp.partition(MLP_LAYERS, pp), 2))
    pipe = schedule.Pipeline(chunks, "1f1b", 2, F.mse_loss, group=mesh.get_group("pp"))
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randn(4, MLP_WIDTH, generator=generator) for _ in range(2))
    found: dict[str, str | float] = {}
    for case, batch in {
        "inputs": (inputs.flip(0) if tp == 1 else inputs, targets),
        "targets": (inputs, targets + tp),
    }.items():
        try:
            pipe.step(*batch)
            found[case] = "accepted"
        except BatchRefused as error:
            found[case] = str(error)
    found["then"] = pipe.step(inputs, targets)
    return found


DELAY = 0.3  # seconds rank 1 sleeps before h0's last all-reduce, in each micro-batch of the delayed step


def timed_collectives(rank: int, world: int) -> dict[str, float]:
    """A GPT step at pp 4 (tp 1) and at pp 2 x tp 2 profiled for tensor parallel's collectives: their
    number and time on this rank beside the step's; then a step in which rank 1 sleeps before the
    all-reduce after h0's ``out``, in each micro-batch, and the least time its tp peer, rank 0, must
    have spent inside that collective: rank 1's waking minus rank 0's arrival (the wall clock both share),
    less rank 0's own work between its arrival and its wait. Last, a profiled step at dp 2 x tp 2."""
    config, m = gpt.GPTConfig(**GPT_CONFIG), 2
    ids, targets = token_batch(4, config.vocab_size, seed=1)
    found: dict[str, float] = {}
    for tp in (1, 2):
        mesh = parallel.init_mesh(1, tp)
        chunks = gpt.GPT.for_rank(config, parallel.pp_rank(mesh), mesh["pp"].size())
        parallel.tensor_parallel(chunks, mesh, gpt.tp_plan(config, tp))
        pipe = schedule.Pipeline(chunks, "1f1b", m, TokenCrossEntropy(), group=mesh.get_group("pp"))
        pipe.step(ids, targets)  # the first step sets up what later ones reuse
        with timing_collectives() as timed:
            pipe.step(ids, targets)
        found |= {
            f"tp{tp} calls": timed.calls,
            f"tp{tp} seconds": timed.seconds,
            f"tp{tp} step": pipe.last.seconds,
        }
    stage, arrivals = parallel.pp_rank(mesh), []
    if stage == 0:
        chunks[0].h0.out.register_forward_pre_hook(lambda *_: _arrive(rank, arrivals))
    with timing_collectives() as delayed:
        pipe.step(ids, targets)
    everyone = comms.all_gather_object(arrivals, "sharing the arrivals")
    waited = sum(max(0.0, wake - came) for came, wake in zip(everyone[0], everyone[1], strict=True))
    found |= {"delayed seconds": delayed.seconds, "rank 0 waited at least": waited, "m": m}
    found["expected calls"] = CALLS_PER_MICROBATCH[stage] * m
    mesh = parallel.init_mesh(2, 2)  # dp 2 x tp 2: FSDP2's gathers and sums are not tp's
    chunks, replicas = built(mesh, gpt.GPT.for_rank(config, 0, 1), gpt.tp_plan(config, 2))
    pipe = pipeline(mesh, "1f1b", chunks, m, TokenCrossEntropy(), replicas)
    mine = my_shard(mesh, ids, targets)
    pipe.step(*mine)
    with timing_collectives() as replicated:
        pipe.step(*mine)
    found |= {"dp2 calls": replicated.calls, "dp2 expected calls": sum(CALLS_PER_MICROBATCH.values()) * m}
    return found


def _arrive(rank: int, arrivals: list[float]) -> None:
    """Rank 0 notes when it reaches the layer; rank 1 notes when it wakes from its sleep there."""
    if rank == 1:
        time.sleep(DELAY)
    arrivals.append(time.time())


def on_four_ranks(rank: int, world: int, runs) -> tuple[dict, dict, dict]:
    return layouts(rank, world, runs), different_batches(rank, world), timed_collectives(rank, world)


AT_PP2 = [
    ("llama", "naive", 2),
    ("mlp", "gpipe", 3),
    ("gpt", "1f1b", 3),
    ("llama-tied", "1f1b", 3),
    ("llama", "interleaved-1f1b", 2),
    ("mlp", "zb-h1", 3),
    ("gpt", "zb-v", 3),
    ("mlp", "dualpipev", 2),
    ("llama", "dualpipev", 3),
]
DP2 = [("mlp", "1f1b", 2), ("gpt", "1f1b", 3), ("llama", "zb-h1", 2)]
FOUR_RANKS = [(1, 2, AT_PP2), (2, 2, DP2)]


@pytest.fixture(scope="module")
def four_ranks() -> list[tuple[dict, dict, dict]]:
    """One launch of four processes for the tests at pp 2 x tp 2 and dp 2 x tp 2."""
    return run_ok(on_four_ranks, 4, FOUR_RANKS, deadline=600)


def test_tp_ranks_given_different_batches_are_refused_on_every_rank_in_one_line_before_the_step(four_ranks):
    first, last = {0: 0, 1: 1, 2: 0, 3: 1}, {0: 2, 1: 3, 2: 2, 3: 3}
    for rank, (_, found, _) in enumerate(four_ranks):
        reads = {"inputs": rank < 2, "targets": rank >= 2}
        for end, stage, peers, owner in (
            ("inputs", "first", "0, 1", first),
            ("targets", "last", "2, 3", last),
        ):
            message = found[end]
            if reads[end]:  # a rank that was given it says what differs
                want = f"the tp ranks of the {stage} stage (ranks {peers}) were given different {end}"
            else:
                want = f"the {stage} stage (rank {owner[rank]}) and its tp peers were given different {end}"
            want = f"rank {rank}: {want}"
            assert message.startswith(want) and "\n" not in message, (rank, end, message)
    losses = [found["then"] for _, found, _ in four_ranks]
    assert len(set(losses)) == 1 and 0 < losses[0] < float("inf"), losses  # the pipeline goes on


def test_tp2_x_pp2_every_schedule_and_dp2_x_tp2_give_the_one_process_loss_gradients_and_norm(four_ranks):
    assert {name for _, name, _ in AT_PP2} == set(SCHEDULE_CHUNKS)
    check(4, FOUR_RANKS, [found for found, _, _ in four_ranks])


def test_the_time_inside_tps_collectives_is_theirs_alone_within_the_step_and_holds_a_peers_delay(four_ranks):
    """What `train`'s summary reports at tp > 1 (observe.collectives): every one of tp's collectives and
    nothing else (no call, no time at tp 1, where the step still sends messages and sums the tie; at
    dp 2 x tp 2 not FSDP2's gathers and sums), some time, never more than the step's; and a tp peer
    that arrives late at a collective shows in it."""
    for rank, (_, _, found) in enumerate(four_ranks):
        assert found["tp1 calls"] == 0 and found["tp1 seconds"] == 0.0, (rank, found)
        assert found["tp2 calls"] == found["expected calls"], (rank, found)
        assert 0.0 < found["tp2 seconds"] <= found["tp2 step"], (rank, found)
        assert found["dp2 calls"] == found["dp2 expected calls"], (rank, found)  # FSDP2's not counted
    rank0 = four_ranks[0][2]
    own_work = 0.05 * rank0["m"]  # rank 0's between its arrival and its wait: a small matmul, a hook
    assert rank0["delayed seconds"] >= rank0["rank 0 waited at least"] - own_work, rank0


@pytest.mark.slow
def test_dp2_x_pp2_x_tp2_on_eight_processes_gives_the_one_process_loss_gradients_and_norm():
    check(8, [(2, 2, [("mlp", "gpipe", 2), ("gpt", "zb-v", 3), ("llama-tied", "1f1b", 2)])])


def test_tp_rank_t_of_stage_s_exchanges_with_tp_rank_t_of_the_stages_beside_it_and_the_program_says_so():
    programs = program.lower(generate("1f1b", 2, 2))
    layout = mesh_layout(8, dp=2, tp=2)  # rank = 4 dp + 2 stage + tp
    on_mesh = {}
    for ranks in pipelines(8, dp=2, tp=2):
        on_mesh.update(zip(ranks, program.on_ranks(programs, ranks), strict=True))
    for rank, runs in on_mesh.items():
        d, s, t = (int(i) for i in (layout == rank).nonzero()[0])
        assert {i.peer for i in runs if i.kind in program.MESSAGES} == {int(layout[d, 1 - s, t])}
    names = [f"rank {r}" for r in range(8)]
    text = program.describe([on_mesh[r] for r in range(8)], names=names).splitlines()
    assert text[6] == (
        "rank 6: SIZES AGREE 1RECV_F0<-4 1F0 1B0 1SEND_B0->4 1RECV_F1<-4 1F1 1B1 1SEND_B1->4 LOSS"
    )
