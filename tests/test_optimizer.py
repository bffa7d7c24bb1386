"""The optimizer and its learning-rate schedule: AdamW with decay on the matrices only, a warm-up then a
decay, every step's rate and gradient norm reported; the same loss curve as a plain PyTorch loop, on every
layout, and across a resume."""

from __future__ import annotations

import io
import math
import sysconfig
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from pipeclock import cli
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.data.prepare import prepare
from pipeclock.data.tokens import TokenDataset
from pipeclock.engine import rng
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.models.gpt import GPTConfig, gpt_sequential
from pipeclock.training.loop import TrainConfig, train
from pipeclock.training.lr_schedule import LRSchedule, resume_line, scheduler_at
from pipeclock.training.optimizer import parameter_groups
from tests.distributed import command, run_ok

GPT = dict(model="gpt", dim=32, layers=4, heads=2, seq_len=32, dropout=0.1, eval_batches=1)
RUN = dict(
    batch_size=8,
    microbatches=2,
    steps=12,
    lr=3e-3,
    optimizer="adamw",
    weight_decay=0.1,
    betas=(0.9, 0.95),
    eps=1e-8,
    lr_schedule="cosine",
    warmup_steps=3,
    min_lr=1e-4,
    clip_grad_norm=0.5,
)
STEPS, WARMUP = RUN["steps"], RUN["warmup_steps"]


def relative_gaps(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


# --- the rate of each step ----------------------------------------------------------------------------


def formula(name: str, s: int, lr: float, steps: int, warmup: int, min_lr: float, decay: int = 0) -> float:
    """The issue's formulas, written out once more."""
    if s < warmup:
        return lr * (s + 1) / warmup
    if name == "constant":
        return lr
    if name == "cosine":
        return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))) / 2
    if name == "linear":
        return lr + (min_lr - lr) * (s - warmup) / (steps - warmup)
    start = steps - decay  # wsd
    return lr if s < start else lr + (min_lr - lr) * (s - start) / decay


@pytest.mark.parametrize(
    "name, warmup, decay",
    [("constant", 0, None), ("constant", 4, None), ("cosine", 5, None), ("cosine", 0, None),
     ("linear", 3, None), ("wsd", 4, 6), ("wsd", 0, 20)],
)  # fmt: skip
def test_the_rate_torchs_scheduler_gives_each_step_is_the_formulas(name, warmup, decay):
    lr, steps, min_lr = 2e-3, 20, 1e-4 if name != "constant" else 0.0
    schedule = LRSchedule(name, lr, steps, warmup, min_lr, decay)
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([weight], lr=lr)
    scheduler = scheduler_at(optimizer, schedule, 0)
    for s in range(steps):
        want = formula(name, s, lr, steps, warmup, min_lr, decay or 0)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=0), (s, want)
        weight.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    resumed = scheduler_at(torch.optim.AdamW([weight], lr=lr), schedule, 7)
    assert resumed.get_last_lr()[0] == pytest.approx(formula(name, 7, lr, steps, warmup, min_lr, decay or 0))


def test_the_warm_up_climbs_to_lr_and_the_decays_end_just_above_min_lr():
    cosine = LRSchedule("cosine", 1.0, 10, 2, 0.1)
    assert [cosine.rate(s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert 0.1 < cosine.rate(9) < cosine.rate(8) and cosine.rate(10) == 0.1
    wsd = LRSchedule("wsd", 1.0, 10, 2, 0.0, 4)
    assert [wsd.rate(s) for s in range(10)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25]


# --- which weights decay ------------------------------------------------------------------------------


def test_weight_decay_falls_on_every_matrix_and_embedding_once_and_never_on_biases_or_norms():
    model = gpt_sequential(GPTConfig(dim=32, layers=2, heads=2, seq_len=32))
    decayed, kept = parameter_groups(model.parameters(), 0.1)
    names = {id(p): name for name, p in model.named_parameters()}  # a tied weight: its first name
    decayed_names = sorted(names[id(p)] for p in decayed["params"])
    kept_names = sorted(names[id(p)] for p in kept["params"])
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.1, 0.0)
    matrices = [
        f"h{i}.{name}.weight"
        for i in range(2)
        for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "fc", "out")
    ]
    assert decayed_names == sorted(["embed.wte.weight", *matrices])  # the tied head: the embedding, once
    assert kept_names and all(name.endswith(".bias") or ".ln" in name for name in kept_names), kept_names
    everything = decayed["params"] + kept["params"]
    assert len({id(p) for p in everything}) == len(everything) == len(list(model.parameters()))
    (only,) = parameter_groups(model.parameters(), 0.0)
    assert only["weight_decay"] == 0.0 and len(only["params"]) == len(everything)


# --- bad values ---------------------------------------------------------------------------------------

BAD = [
    (["--betas", "0.9,1.0"], "--betas must be two numbers B1,B2 each in [0, 1), got 0.9,1"),
    (["--betas", "0.9"], "argument --betas: must be two numbers B1,B2"),
    (["--eps", "0"], "argument --eps: must be a number > 0, got 0"),
    (["--optimizer", "adamw", "--weight-decay", "-0.1"], "argument --weight-decay: must be a number >= 0"),
    (["--weight-decay", "0.1"], "--weight-decay 0.1 needs --optimizer adamw"),
    (["--steps", "10", "--warmup-steps", "11"], "--warmup-steps 11 is longer than the run (--steps 10)"),
    (
        ["--lr-schedule", "wsd", "--steps", "10", "--decay-steps", "11"],
        "--decay-steps 11 is longer than the run",
    ),
    (["--lr-schedule", "wsd"], "--lr-schedule wsd needs --decay-steps N"),
    (
        ["--lr-schedule", "cosine", "--decay-steps", "3"],
        "--decay-steps 3 is for --lr-schedule wsd, not cosine",
    ),
    (["--lr-schedule", "cosine", "--lr", "1e-3", "--min-lr", "2e-3"], "--min-lr 0.002 is above --lr 0.001"),
    (["--min-lr", "1e-5"], "--min-lr 1e-05 is where a decay ends"),
    (
        ["--lr-schedule", "wsd", "--steps", "10", "--warmup-steps", "6", "--decay-steps", "5"],
        "--warmup-steps 6 and --decay-steps 5 overlap",
    ),
]


def test_each_bad_optimizer_or_schedule_value_is_one_line_and_exit_2():
    for flags, message in BAD:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(["train", *flags])
        assert code == 2 and message in err.getvalue(), (flags, code, err.getvalue())
        assert err.getvalue().count("\n") == 1 and not out.getvalue(), (flags, err.getvalue())


# --- the runs -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """A prepared token folder (``prepare``, bytes) of the standard library's first 40 modules: the runs
    below read their batches from its shards."""
    folder = tmp_path_factory.mktemp("tokens")
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    prepare([str(path) for path in sources], folder / "data", validation_fraction=0.1)
    return str(folder / "data")


def reference_run(data: str) -> tuple[list[float], list[float], list[float]]:
    """Plain PyTorch on one process: the whole GPT and batch, AdamW over the decay groups, torch's own
    warm-up and cosine schedulers, ``clip_grad_norm_``. Its losses, rates and unclipped norms."""
    corpus = TokenDataset(data)
    vocabulary = -(-corpus.vocab_size // 64) * 64  # the GPT pads a dataset's vocabulary to 64s
    gpt = GPTConfig(dim=32, layers=4, heads=2, seq_len=32, dropout=0.1, seed=0, vocab_size=vocabulary)
    model = gpt_sequential(gpt)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": RUN["weight_decay"]}, {"params": others, "weight_decay": 0.0}],
        lr=RUN["lr"],
        betas=RUN["betas"],
        eps=RUN["eps"],
    )
    warm = LinearLR(optimizer, 1 / WARMUP, 1.0, total_iters=WARMUP - 1)
    decay = CosineAnnealingLR(optimizer, T_max=STEPS - WARMUP, eta_min=RUN["min_lr"])
    scheduler = SequentialLR(optimizer, [warm, decay], milestones=[WARMUP])
    loss_fn = TokenCrossEntropy()
    losses, rates, norms = [], [], []
    for step in range(STEPS):
        ids, targets = corpus.batch(step, RUN["batch_size"], 32, seed=0)
        optimizer.zero_grad()
        with rng.keyed(step, 0):
            loss = loss_fn.mean(model(ids), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), RUN["clip_grad_norm"])))
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, rates, norms


def figures(result) -> dict[str, list[float]]:
    return {"losses": result.losses, "lrs": result.lrs, "grad_norms": result.grad_norms}


def one_process_runs(rank: int, world: int, directory: str, data: str) -> dict:
    """The run straight, with a checkpoint after step 6; the same run resumed there into another folder;
    and a resume there that asks for 16 steps, through the command, for what it says."""
    straight = Path(directory) / "straight"
    found = {
        "straight": figures(
            train(TrainConfig(**GPT, **RUN, data=data, checkpoint_dir=str(straight), checkpoint_every=6))
        )
    }
    again = dict(checkpoint_dir=str(Path(directory) / "again"), resume=str(straight / "step_000006"))
    found["resumed"] = figures(train(TrainConfig(**GPT, **RUN, **again, data=data)))
    longer = [
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if k == 'betas' else v}" for k, v in RUN.items()
    ]
    argv = [
        "train",
        *(f"--{k.replace('_', '-')}={v}" for k, v in GPT.items()),
        *longer,
        "--steps=16",
        f"--data={data}",
    ]
    argv += [f"--checkpoint-dir={Path(directory) / 'longer'}", f"--resume={straight / 'step_000006'}"]
    found["longer"] = command(rank, world, argv)
    found["saved"] = checkpoint_choice.read_run(straight / "step_000006")
    return found


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tokens) -> dict:
    (found,) = run_ok(one_process_runs, 1, str(tmp_path_factory.mktemp("optim")), tokens, deadline=300)
    return found


def test_one_process_train_follows_plain_pytorch_adamw_with_torchs_schedulers_step_for_step(
    one_process, tokens
):
    losses, rates, norms = reference_run(tokens)
    run = one_process["straight"]
    assert losses[-1] < losses[0] - 0.5, "the GPT really learns"
    assert relative_gaps(run["losses"], losses) <= 1e-6
    assert relative_gaps(run["lrs"], rates) <= 1e-12
    assert relative_gaps(run["grad_norms"], norms) <= 1e-6
    assert max(norms) > RUN["clip_grad_norm"], "the clipping bites"


def test_six_steps_resumed_to_twelve_are_the_straight_run_bit_for_bit(one_process):
    straight, resumed = one_process["straight"], one_process["resumed"]
    assert {name: values[6:] for name, values in straight.items()} == resumed
    saved = one_process["saved"]["lr_scheduler"]  # the scheduler's position, in the checkpoint
    assert saved == {"last_epoch": 6, "last_lr": [straight["lrs"][6]] * len(saved["last_lr"])}


def test_a_resume_that_changes_steps_says_in_one_line_what_happens_to_the_decay(one_process):
    printed = one_process["longer"]
    assert printed.code == 0, printed.err
    lines = [line for line in printed.out.splitlines() if "decay" in line]
    rate = LRSchedule("cosine", RUN["lr"], 16, WARMUP, RUN["min_lr"]).rate(6)
    old = LRSchedule("cosine", RUN["lr"], 12, WARMUP, RUN["min_lr"]).rate(6)
    assert lines == [
        f"resume: the cosine decay now runs from step 3 to step 16 (it ended at step 12); step 6's rate "
        f"is {rate:.4g}, not {old:.4g} as on the checkpoint's curve"
    ], printed.out
    assert "final loss" in printed.out.splitlines()[-1] and "after 16 steps" in printed.out


def test_the_resume_line_says_where_a_wsd_decay_moves_and_nothing_for_a_constant_rate():
    wsd = LRSchedule("wsd", 1e-3, 20, 2, 1e-4, 5)
    saved = dict(lr_schedule="wsd", lr=1e-3, steps=10, warmup_steps=2, min_lr=1e-4, decay_steps=5)
    assert resume_line(saved, wsd, 6) == (
        "resume: the wsd decay now runs from step 15 to step 20 (it ended at step 10); step 6's rate is "
        "0.001, not 0.00082 as on the checkpoint's curve"
    )
    assert resume_line({**saved, "steps": 20}, wsd, 6) is None  # the same --steps
    assert resume_line(saved, LRSchedule("constant", 1e-3, 20), 6) is None  # no decay to move


LAYOUTS = {"dp2 x pp2": dict(dp=2), "pp2 x tp2": dict(tp=2)}
UNCLIPPED = dict(tp=2, dp=1, clip_grad_norm=None, steps=1, lr_schedule="constant", warmup_steps=0, min_lr=0.0)


def layout_runs(rank: int, world: int, layouts: dict[str, dict], data: str) -> dict[str, dict]:
    return {
        name: figures(train(TrainConfig(**GPT, **{**RUN, **options}, data=data)))
        for name, options in layouts.items()
    }


def check_layouts(per_rank: list[dict], one: dict) -> None:
    for name in per_rank[0]:
        assert all(rank[name] == per_rank[0][name] for rank in per_rank), f"{name}: every rank agrees"
        run = per_rank[0][name]
        assert relative_gaps(run["losses"], one["losses"]) <= 1e-5, name
        assert relative_gaps(run["grad_norms"], one["grad_norms"]) <= 1e-5, name
        assert run["lrs"] == one["lrs"], name


def test_dp2_x_pp2_and_pp2_x_tp2_follow_the_one_process_curve_and_norms_clipped_or_not(one_process, tokens):
    per_rank = run_ok(layout_runs, 4, {**LAYOUTS, "unclipped": UNCLIPPED}, tokens, deadline=400)
    unclipped = [found.pop("unclipped") for found in per_rank]
    check_layouts(per_rank, one_process["straight"])
    first_norm = one_process["straight"]["grad_norms"][0]  # before any update: the same gradient
    assert all(relative_gaps(run["grad_norms"], [first_norm]) <= 1e-5 for run in unclipped), unclipped


@pytest.mark.long  # eight processes on two cores: 30 s
def test_dp2_x_pp2_x_tp2_follows_the_one_process_curve_every_step(one_process, tokens):
    per_rank = run_ok(layout_runs, 8, {"dp2 x pp2 x tp2": dict(dp=2, tp=2)}, tokens, deadline=500)
    check_layouts(per_rank, one_process["straight"])


def test_a_hugging_face_models_norm_weights_keep_clear_of_weight_decay_and_its_matrices_decay():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    decayed, kept = parameter_groups(model.parameters(), 0.1)
    names = {id(p): name for name, p in model.named_parameters()}
    assert all("norm" in names[id(p)] for p in kept["params"]) and len(kept["params"]) == 2 * 2 + 1
    assert {names[id(p)] for p in decayed["params"]} >= {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(p.ndim == 2 for p in decayed["params"])
