"""``train --ep N`` from the command line: refused in one line where it cannot work, exact where it runs,
and its checkpoints whole: a run saved with ep 2 resumes with ep 1 and on another pp, and exports.

Each refusal that needs the model is a launch of two ranks, those of the flags alone run in this
process; each run is a launch of its own (long); the export and its reading by ``transformers`` follow
on this process.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed import command, run_ok

RUN = ["train", "--model", "hf", "--steps", "3", "--seq-len", "16", "--batch-size", "4",
       "--microbatches", "2", "--eval-every", "0", "--eval-batches", "1"]  # fmt: skip
EP_PLAN = {
    "layers.*.mlp.experts": "ep_dispatch_experts",
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
}
# Each refusal: the flags after ``train`` (``{dir}``: the test's folder), and what its one line must say.
# These need the model, so they run on two ranks (every rank refuses alike, before the first step) ...
MODEL_REFUSALS = {
    "ep on a dense model": ("--hf-config {dir}/dense --dp 2 --ep 2", "LlamaConfig is a dense model"),
    "ep not dividing the experts": (
        "--hf-config {dir}/three --dp 2 --ep 2",
        "does not divide the model's 3 experts",
    ),
    "a plan naming what the model lacks": (
        "--hf-config {dir}/moe --dp 2 --ep 2 --ep-plan {dir}/absent.json",
        "names model.layers.*.block_sparse_moe.experts, which the model does not have",
    ),
    "a plan with a style not applied": (
        "--hf-config {dir}/moe --dp 2 --ep 2 --ep-plan {dir}/gather.json",
        "which pipeclock does not apply",
    ),
}
# ... and these only the flags: refused before any process group, here.
FLAG_REFUSALS = {
    "ep not dividing dp": ("--hf-config {dir}/moe --dp 2 --ep 3", "--ep 3 does not divide --dp 2"),
    "ep on the MLP": ("--model mlp --hidden 8 --layers 2 --dp 2 --ep 2", "--model mlp has none"),
    "ep on the GPT": ("--model gpt --dp 2 --ep 2", "--model gpt has none"),
    "an ep plan without ep": ("--hf-config {dir}/moe --dp 2 --ep-plan {dir}/plan.json", "needs --ep N"),
    "ep with tp": ("--hf-config {dir}/moe --dp 2 --ep 2 --tp 2", "--ep 2 with --tp 2"),
    "ep with ddp": ("--hf-config {dir}/moe --dp 2 --ep 2 --data-parallel ddp", "takes --data-parallel fsdp"),
}


def write_models(folder: Path) -> None:
    from transformers import LlamaConfig, MixtralConfig

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300)  # fmt: skip
    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
    MixtralConfig(**sizes, **moe, num_local_experts=4).save_pretrained(folder / "moe")
    MixtralConfig(**sizes, **moe, num_local_experts=3).save_pretrained(folder / "three")
    LlamaConfig(**sizes).save_pretrained(folder / "dense")
    (folder / "plan.json").write_text(json.dumps(EP_PLAN))
    (folder / "gather.json").write_text(json.dumps({**EP_PLAN, "layers.*.mlp.experts": "gather"}))
    absent = {**EP_PLAN, "layers.*.block_sparse_moe.experts": "ep_dispatch_experts"}
    (folder / "absent.json").write_text(json.dumps(absent))
    sentence = "experts take the tokens routed to them and send back what they made of them. "
    (folder / "text.txt").write_text(sentence * 600)


def run(rank: int, world: int, flags: list[str]) -> tuple[int, str, str]:
    """One run on this rank: its exit code, standard output and error."""
    printed = command(rank, world, [*RUN, *flags])
    return printed.code, printed.out, printed.err


def runs(folder: Path) -> dict[str, tuple[int, str, str]]:
    """Rank 0's account of each run, one launch each: ep 2 saving at step 2, the same without ep, and the
    saved run resumed with ep 1 and on two stages (each in fresh processes, as torchrun starts them)."""
    moe = ["--hf-config", f"{folder}/moe", "--data", f"{folder}/text.txt"]
    asked = {
        "ep 2, saved at step 2": [*moe, "--dp", "2", "--ep", "2", "--steps", "2",
                                  "--checkpoint-dir", f"{folder}/a"],
        "dp 2 without ep": [*moe, "--dp", "2"],
        "resumed with ep 1": [*moe, "--dp", "2", "--checkpoint-dir", f"{folder}/a", "--resume"],
        # micro-batches of one sample, as the dp 2 runs' (the auxiliary loss is per micro-batch)
        "resumed on pp 2": [*moe, "--checkpoint-dir", f"{folder}/b", "--resume", "--microbatches", "4"],
    }  # fmt: skip
    found = {}
    for name, flags in asked.items():
        if name == "resumed with ep 1":  # the saved run, kept for the pp 2 resume
            shutil.copytree(folder / "a", folder / "b", ignore=shutil.ignore_patterns("*.lock"))
        found[name] = run_ok(run, 2, flags, deadline=600)[0]
    return found


def losses(out: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"step\s+(\d+)\s+loss ([0-9.]+)", out)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    found = tmp_path_factory.mktemp("ep_runs")
    write_models(found)
    return found


@pytest.fixture(scope="module")
def launched(folder) -> dict[str, tuple[int, str, str]]:
    return runs(folder)


# Each is a launch of its own (about 5 s): the first in every run, the rest with the long tests.
MODEL_CASES = [pytest.param(n, marks=[pytest.mark.long] if i else []) for i, n in enumerate(MODEL_REFUSALS)]


@pytest.mark.parametrize("name", MODEL_CASES)
def test_ep_that_the_model_cannot_take_is_one_line_and_exit_2_on_every_rank_before_the_first_step(
    name, folder
):
    flags, says = MODEL_REFUSALS[name]
    asked = ["--data", f"{folder}/text.txt", *flags.format(dir=folder).split()]
    for rank, (code, out, err) in enumerate(run_ok(run, 2, asked, deadline=600)):
        assert code == 2, (rank, name, code, err)
        assert len(err.strip().splitlines()) == 1 and says in err, (rank, name, err)
        assert "loss" not in out, (rank, name, out)


@pytest.mark.parametrize("name", list(FLAG_REFUSALS))
def test_ep_flags_that_cannot_work_together_are_one_line_and_exit_2(name, folder, capsys):
    from pipeclock.cli.dispatch import main

    flags, says = FLAG_REFUSALS[name]
    assert main([*RUN, *flags.format(dir=folder).split()]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert "loss" not in out


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_ep2_follows_dp2_step_by_step_and_its_checkpoint_resumes_with_ep1_and_on_pp2(launched):
    found = launched
    for name in ("ep 2, saved at step 2", "dp 2 without ep", "resumed with ep 1", "resumed on pp 2"):
        assert found.get(name, (None,))[0] == 0, (name, found.get(name, "not run"))
    plain = losses(found["dp 2 without ep"][1])
    with_ep = losses(found["ep 2, saved at step 2"][1])
    assert sorted(plain) == [0, 1, 2] and sorted(with_ep) == [0, 1]
    for step, loss in with_ep.items():
        assert loss == pytest.approx(plain[step], abs=2e-6), step
    for name in ("resumed with ep 1", "resumed on pp 2"):
        assert "resumed from" in found[name][1] and "at step 2" in found[name][1], name
        assert losses(found[name][1]) == pytest.approx({2: plain[2]}, abs=2e-6), name
    layouts = {"resumed with ep 1": "now 1 stage(s) x 2 replicas)", "resumed on pp 2": "now 2)"}
    for name, now in layouts.items():  # the layout line names the ep the checkpoint was saved with
        assert f"saved by 1 stage(s) x 2 replicas, experts over ep 2, {now}" in found[name][1], name


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_a_checkpoint_saved_with_ep2_exports_whole_experts_that_transformers_loads(
    launched, folder, tmp_path
):
    from transformers import AutoModelForCausalLM

    from pipeclock.checkpoints.save_load import load_full_model
    from pipeclock.cli.dispatch import main

    saved = folder / "a" / "step_000002"
    assert main(["export", str(saved), "--hf", str(tmp_path / "hf")]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    state, _ = load_full_model(saved)
    experts = [name for name in state if name.endswith("experts.gate_up_proj")]
    assert experts and all(state[name].shape[0] == 4 for name in experts), "every expert, under HF's names"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
