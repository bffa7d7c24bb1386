"""Every tensor-parallel plan is exact or refused in one line, never silently wrong.

A plan that leaves a stage's output split, reads a slice as whole, or splits the wrong neighbour is
refused in the stage's first forward, naming the module, before it reads anything laid out wrong; a
replicated module fed a slice (Qwen3's and Gemma3's per-head norms) has its gradient summed over tp, so
its copies stay equal and one process's; a norm with a weight per head (Cohere's ``use_qk_norm``) is
split with its heads, or refused when a plan keeps it whole; dropout between the splits draws this
rank's slice of the one process's mask; every style ``transformers`` writes is translated or refused by
name.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from pipeclock import parallel, schedule
from pipeclock.engine.step_run import StageError
from pipeclock.engine.ties import tie_key
from pipeclock.models import gpt, mlp
from tests.distributed import command, run_ok, start_ranks
from tests.hf_cases import padded_batch, reference, relative_gap
from tests.jobs import LAUNCH_TIMEOUT, losses_of

TOLERANCE = 2e-5


def small(family: str, **extra):
    """A tiny config of ``family`` (4 heads, 2 key-value heads of 4 dims) with a tp plan of its own."""
    import transformers

    config_class = {
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
        "cohere": transformers.CohereConfig,
        "llama": transformers.LlamaConfig,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[family]
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    sizes |= dict(num_key_value_heads=2, head_dim=4, vocab_size=300, max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_class(**(sizes | extra), pad_token_id=0, bos_token_id=0, eos_token_id=0)


def hf_gaps(config, mesh, given=None, m: int = 2, padded: bool = True) -> dict[str, float]:
    """A second step of ``config`` split by tp (pp from the mesh; the first runs the plan's check) against
    transformers' own forward and backward: the loss's gap, the worst gradient's, and the largest
    difference between tp ranks' copies of a replicated gradient. Dropout drawn by function (keyed by
    micro-batch) needs ``m`` 1 to meet the reference's draws; so does a router's auxiliary loss (a function
    of the whole batch's routing), which also counts the padding (``padded`` False: none)."""
    from pipeclock.models import hf

    pp = mesh["pp"].size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chunks = [hf.split(config, parallel.pp_rank(mesh), pp, seed=5)]
    parallel.tensor_parallel(chunks, mesh, hf.tp_plan(config, mesh["tp"].size(), given))
    (ids, mask), labels = padded_batch(5, 8, seed=1)
    if not padded:
        mask = torch.ones_like(mask)
    pipe = schedule.Pipeline(chunks, "1f1b", m, hf.loss(config), group=mesh.get_group("pp"))
    pipe.step((ids, mask), labels)
    chunks[0].zero_grad(set_to_none=True)
    loss = pipe.step((ids, mask), labels)
    want_loss, want = reference(config, 5, (ids, mask), labels, step=1)
    grads, copies = [], []
    for name, p in chunks[0].named_parameters():
        if hasattr(p.grad, "full_tensor"):
            got = p.grad.full_tensor()
        else:
            got = p.grad
            everyone = [torch.empty_like(got) for _ in range(mesh["tp"].size())]
            torch.distributed.all_gather(everyone, got.contiguous(), group=mesh.get_group("tp"))
            copies.append(max((e - got).abs().max().item() for e in everyone))
        whole = want[tie_key(p) or name]
        grads.append(relative_gap(got.reshape(whole.shape), whole))  # gate_up held [.., 2, inter, ..]
    return {"loss": abs(loss - want_loss) / abs(want_loss), "grad": max(grads), "copies": max(copies)}


def refused(attempt) -> str:
    try:
        attempt()
        return "accepted"
    except (ValueError, StageError) as error:
        return str(error)


def gpt_step(plan: dict[str, str], mesh) -> str:
    config = gpt.GPTConfig(dim=16, layers=2, heads=2, seq_len=8, seed=11)
    chunks = gpt.GPT.for_rank(config, 0, 1)

    def attempt():
        parallel.tensor_parallel(chunks, mesh, plan, "--tp-plan bad.json")
        ids = torch.randint(0, config.vocab_size, (2, 8))
        chunks[0](ids)

    return refused(attempt)


def mlp_step(plan: dict[str, str], mesh, width: int = 16) -> str:
    chunks = mlp.ShardedMLP.for_rank(width, 2, 0, 1, seed=3)

    def attempt():
        parallel.tensor_parallel(chunks, mesh, plan, "--tp-plan bad.json")
        chunks[0](torch.randn(3, width))

    return refused(attempt)


def hf_refusal(config, mesh, given=None) -> str:
    return refused(lambda: hf_gaps(config, mesh, given))


def refusals_at_tp2(rank: int, world: int) -> dict[str, str]:
    mesh = parallel.init_mesh(1, world)
    gpt_plan = gpt.tp_plan(gpt.GPTConfig(dim=16, layers=2, heads=2, seq_len=8), 2)
    without_v = {k: v for k, v in gpt_plan.items() if not k.endswith(".v")}
    swapped = {k: {"colwise": "rowwise", "rowwise": "colwise"}.get(v, v) for k, v in gpt_plan.items()}
    refusals = {
        "mlp output split": mlp_step({"layers.1": "colwise"}, mesh),
        "mlp last layer at 64": mlp_step({"layers.1": "colwise"}, mesh, 64),
        "gpt without v": gpt_step(without_v, mesh),
        "gpt only fc": gpt_step({"h*.fc": "colwise"}, mesh),
        "gpt only out": gpt_step({"h*.out": "rowwise"}, mesh),
        "gpt swapped": gpt_step(swapped, mesh),
        "gpt rowwise_rep after a column split": gpt_step(gpt_plan | {"h*.attn.proj": "rowwise_rep"}, mesh),
        "sequence parallel": gpt_step(gpt_plan | {"h*.ln1": "sequence_parallel"}, mesh),
        "cohere qk norm replicated": hf_refusal(
            small("cohere", use_qk_norm=True),
            mesh,
            small("cohere").base_model_tp_plan | {"layers.*.self_attn.q_norm": "replicate"},
        ),
        "packed outside experts": hf_refusal(
            small("qwen3"),
            mesh,
            small("qwen3").base_model_tp_plan | {"layers.*.mlp.gate_proj": "packed_colwise"},
        ),
        "experts at an odd width": hf_refusal(small("mixtral", intermediate_size=15), mesh),
    }
    return refusals


def mixtures() -> dict:
    """Mixtral and Qwen3-MoE with the routers' auxiliary loss weighing in (0.5), four experts, two a token."""
    routed = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)
    return {
        "mixtral": small("mixtral", num_local_experts=4, **routed),
        "qwen3 moe": small("qwen3_moe", num_experts=4, moe_intermediate_size=8, **routed),
    }


def exact_at_tp2(rank: int, world: int) -> dict[str, dict[str, float]]:
    mesh = parallel.init_mesh(1, world)
    qwen3_replicate = {
        **small("qwen3").base_model_tp_plan,
        "layers.*.self_attn.q_norm": "replicate",
        "layers.*.self_attn.k_norm": "replicate",
    }
    return {
        "qwen3": hf_gaps(small("qwen3"), mesh),
        "qwen3 replicate": hf_gaps(small("qwen3"), mesh, qwen3_replicate),
        "gemma3": hf_gaps(small("gemma3"), mesh),
        "cohere qk norm split with its heads": hf_gaps(small("cohere", use_qk_norm=True), mesh),
        "llama attention dropout": hf_gaps(small("llama", attention_dropout=0.1), mesh, m=1),
        "qwen3 attention dropout": hf_gaps(small("qwen3", attention_dropout=0.1), mesh, m=1),
        **{name: hf_gaps(config, mesh, m=1, padded=False) for name, config in mixtures().items()},
    }


def test_plans_that_cannot_work_are_refused_in_one_line_naming_the_module():
    expected = {
        "mlp output split": "leaves the stage's output split: layers.1 (colwise)",
        "mlp last layer at 64": "leaves the stage's output split: layers.1 (colwise)",
        "gpt without v": "h0.attn.v is whole on every rank but runs after h0.attn.k (colwise)",
        "gpt only fc": "h0.out is whole on every rank but runs after h0.fc (colwise)",
        "gpt only out": "h0.out (rowwise) expects each rank's slice of its input, but nothing",
        "gpt swapped": "h0.attn.q (rowwise) expects each rank's slice of its input",
        "gpt rowwise_rep after a column split": "h0.attn.proj (rowwise_rep) takes a whole input but runs "
        "after h0.attn.v (colwise)",
        "sequence parallel": "asks for 'sequence_parallel' at h*.ln1, which pipeclock does not translate",
        "cohere qk norm replicated": "model.layers.0.self_attn.q_norm is whole on every rank but runs on "
        "each rank's slice",
        "packed outside experts": "asks for 'packed_colwise' at model.layers.*.mlp.gate_proj, which "
        "pipeclock does not translate to a torch ParallelStyle (a fused weight (gate and up stacked) "
        "outside a moe_tp_experts module",
        "experts at an odd width": "--tp 2 does not divide the 15 intermediate features of "
        "model.layers.0.mlp.experts.gate_up_proj (packed_colwise)",
    }
    for rank, found in enumerate(run_ok(refusals_at_tp2, 2, deadline=600)):
        for case, message in found.items():
            assert expected[case] in message and "\n" not in message, (rank, case, message)


def test_per_head_norms_dropout_and_mixtures_of_experts_train_at_tp2_as_one_process():
    for rank, exact in enumerate(run_ok(exact_at_tp2, 2, deadline=600)):
        for case, gaps in exact.items():
            assert gaps["loss"] < TOLERANCE and gaps["grad"] < TOLERANCE, (rank, case, gaps)
            assert gaps["copies"] == 0.0, (rank, case, gaps)  # the replicated copies stay one


def at_pp2_x_tp2(rank: int, world: int) -> dict[str, dict[str, float]]:
    mesh = parallel.init_mesh(1, 2)
    return {
        "qwen3": hf_gaps(small("qwen3"), mesh),
        "gemma3": hf_gaps(small("gemma3"), mesh),
        "llama attention dropout": hf_gaps(small("llama", attention_dropout=0.1), mesh, m=1),
        "cohere qk norm": hf_gaps(small("cohere", use_qk_norm=True), mesh),
        **{name: hf_gaps(config, mesh, m=1, padded=False) for name, config in mixtures().items()},
    }


@pytest.mark.long
def test_per_head_norms_dropout_and_mixtures_of_experts_train_at_pp2_x_tp2_as_one_process():
    for rank, exact in enumerate(run_ok(at_pp2_x_tp2, 4, deadline=600)):
        for case, gaps in exact.items():
            assert gaps["loss"] < TOLERANCE and gaps["grad"] < TOLERANCE, (rank, case, gaps)
            assert gaps["copies"] == 0.0, (rank, case, gaps)


def test_train_refuses_a_plan_that_leaves_the_output_split_in_one_line_on_every_rank(tmp_path):
    """The MLP whose last Linear is column-split, nothing after it: one process trains it to 0.823373,
    the split plan would have trained to 0.739212 on each rank's half of the output. Now every rank says
    why, in one line, and exits 2."""
    plan = tmp_path / "plan.json"
    plan.write_text('{"layers.1": "colwise"}')
    flags = "train --model mlp --hidden 16 --layers 2 --tp 2 --steps 2 --batch-size 4 --microbatches 2"
    argv = [*flags.split(), "--tp-plan", str(plan)]
    ranks = start_ranks(command, 2, argv, deadline=LAUNCH_TIMEOUT).values()
    for rank, said in enumerate(ranks):
        errors = [line for line in said.err.splitlines() if line.startswith("pipeclock train: error:")]
        assert said.code == 2 and len(errors) == 1, (rank, said.code, said.err)
        want = f"rank {rank}: --tp-plan {plan} leaves the stage's output split: layers.1 (colwise)"
        assert want in errors[0], errors
        assert "Traceback" not in said.err, said.err


@pytest.mark.long
def test_mixtral_trains_at_pp2_x_tp2_as_one_process_and_its_checkpoint_moves_to_pp2_and_back(tmp_path):
    """The main job: Mixtral (router loss on) at pp 2 x tp 2 follows one process's losses; its checkpoint
    (each rank its slice of every expert's gate and up) resumes at pp 2 alone, a pp 2 checkpoint at
    pp 2 x tp 2, each with the uninterrupted run's next losses; ``export --hf`` gives transformers' shape."""
    config = mixtures()["mixtral"]
    config.save_pretrained(tmp_path / "mixtral")
    flags = ["train", "--model", "hf", "--hf-config", str(tmp_path / "mixtral"), "--seq-len", "16"]
    flags += ["--batch-size", "4", "--microbatches", "2", "--lr", "0.01"]

    def run(world: int, name: str, steps: int, *more: str) -> list[float]:
        argv = [*flags, "--steps", str(steps), "--losses", str(tmp_path / f"{name}.json"), *more]
        said = start_ranks(command, world, argv, deadline=LAUNCH_TIMEOUT).values()
        assert all(r.code == 0 for r in said), [(r.code, r.err) for r in said]
        return losses_of(tmp_path / f"{name}.json")[1]

    want = run(1, "one", 5)
    assert run(4, "tp", 3, "--tp", "2", "--checkpoint-dir", str(tmp_path / "tp")) == pytest.approx(
        want[:3], rel=1e-5
    )
    assert run(2, "pp", 3, "--checkpoint-dir", str(tmp_path / "pp")) == pytest.approx(want[:3], rel=1e-5)
    resumed = {
        "tp to pp": run(2, "tp to pp", 5, "--checkpoint-dir", str(tmp_path / "tp"), "--resume"),
        "pp to tp": run(4, "pp to tp", 5, "--tp", "2", "--checkpoint-dir", str(tmp_path / "pp"), "--resume"),
    }
    for name, got in resumed.items():
        assert got == pytest.approx(want[3:], rel=1e-5), name
    said = start_ranks(command, 1, ["export", str(tmp_path / "tp"), "--hf", str(tmp_path / "hf")]).values()
    assert all(r.code == 0 for r in said), [r.err for r in said]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    experts = exported.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 2 * config.intermediate_size, config.hidden_size)
