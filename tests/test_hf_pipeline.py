"""Hugging Face causal LMs, unmodified, pipelined: the one-process loss and gradients, on real processes.

GPT-2 (learned positions, a head tied to the embedding, dropout) and Llama (rotary positions,
grouped-query attention, an untied head) from tiny configs, cut by ``hf.split``, with padded batches
(``attention_mask`` and -100 labels): one pipelined step leaves the loss and every gradient within 1e-5
relative of the unmodified HF model on one process called with ``labels=`` on the same weights.

A launch costs seconds (each rank imports transformers), a case a fraction of one, so there is one launch
per stage count p in {1, 2, 3, 4}, and every check of that p runs inside it (`launch`). Within a launch
each schedule runs once, on GPT-2 or Llama in turn (the other model at the next p), with m taken in turn
from {1, p, 2p + 1}; across the launches every schedule meets both models and m in {1, p, 2p + 1}. GPT-2
runs with dropout at odd p. The same launches train 20 steps through ``train`` (p <= 3), and the p = 2
run's checkpoint is exported for ``transformers`` to load. Batches whose length changes from step to step
run in a launch of their own: the engine does not take them yet, and its failure can end the processes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from pipeclock import schedule
from pipeclock.app.train import TrainConfig, train
from tests.cases import PLACEMENT, SCHEDULE_CHUNKS
from tests.distributed import run_ok, run_ranks
from tests.hf_cases import (
    CONFIGS,
    gpt2_config,
    llama_config,
    padded_batch,
    reference,
    worst_gap,
)

TOLERANCE = 1e-5


def cases_for(p: int) -> list[tuple[str, str, int]]:
    """(model, schedule, m): every schedule once, the model alternating, m turning through {1, p, 2p + 1}."""
    counts, models = [1, p, 2 * p + 1], list(CONFIGS)
    return [
        (models[(index + p) % 2], name, counts[(index + p) % 3]) for index, name in enumerate(SCHEDULE_CHUNKS)
    ]


def one_case(rank: int, p: int, model: str, name: str, m: int) -> float:
    import warnings

    from pipeclock.models import hf

    config = gpt2_config(dropout=0.1) if model == "gpt2" and p % 2 else CONFIGS[model]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chunks = hf.split(
            config, rank, p, chunks=SCHEDULE_CHUNKS[name], placement=PLACEMENT.get(name), seed=5
        )
    chunks = chunks if isinstance(chunks, list) else [chunks]
    inputs, labels = padded_batch(2 * m + 1, 8, seed=m + p)
    loss = schedule.Pipeline(chunks, name, m, hf.loss()).step(inputs, labels)
    return worst_gap(loss, chunks, *reference(config, 5, inputs, labels))


def training(config_dir: str, p: int, checkpoint_dir: str | None = None, **more) -> TrainConfig:
    settings = dict(
        model="hf", hf_config=config_dir, steps=20, batch_size=6, microbatches=3, seq_len=16,
        eval_every=0, eval_batches=1, seed=2, checkpoint_dir=checkpoint_dir,
    )  # fmt: skip
    return TrainConfig(**{**settings, **more})


def changing_lengths(rank: int, p: int) -> float:
    """Two steps of Llama whose batches are 8 then 12 tokens long: the worst gap from one process."""
    from pipeclock.models import hf

    torch.set_num_threads(1)
    config = llama_config()
    chunks = [hf.split(config, rank, p, seed=5)]
    pipe = schedule.Pipeline(chunks, "1f1b", 2, hf.loss())
    gaps = []
    for tokens in (8, 12):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        inputs, labels = padded_batch(5, tokens, seed=tokens)
        loss = pipe.step(inputs, labels)
        gaps.append(worst_gap(loss, chunks, *reference(config, 5, inputs, labels)))
    return max(gaps)


def engine_features(rank: int, p: int) -> dict[str, float]:
    """Recompute on the decoder layers (whole and split backward) and bf16: each one step of Llama."""
    from pipeclock.models import hf

    config, found = llama_config(), {}
    inputs, labels = padded_batch(7, 8, seed=3)
    want = reference(config, 5, inputs, labels)
    for name in ("1f1b", "zb-h1"):
        chunks = [hf.split(config, rank, p, seed=5)]
        pipe = schedule.Pipeline(chunks, name, 3, hf.loss(), recompute="every-1")
        found[f"recompute {name}"] = worst_gap(pipe.step(inputs, labels), chunks, *want)
    chunks = [hf.split(config, rank, p, seed=5)]
    bf16 = schedule.Pipeline(chunks, "1f1b", 3, hf.loss(), dtype="bf16").step(inputs, labels)
    found["bf16 loss gap"] = abs(bf16 - want[0]) / want[0]
    return found


def everything_on(rank: int, p: int, workdir: str) -> dict:
    torch.set_num_threads(1)
    found: dict = {"matrix": {case: one_case(rank, p, *case) for case in cases_for(p)}}
    if p <= 3:
        checkpoints = f"{workdir}/checkpoints" if p == 2 else None
        result = train(training(f"{workdir}/llama", p, checkpoints))
        found["losses"], found["validation"] = result.losses, result.validation
    if p == 2:
        found["features"] = engine_features(rank, p)
    if p == 4:  # two replicas of a 2-stage pipeline
        for kind in ("fsdp", "ddp"):
            run = train(training(f"{workdir}/llama", p, dp=2, data_parallel=kind, steps=10))
            found[f"losses {kind}"] = run.losses
    return found


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """``launch(p)``: every rank's findings of the one launch on p processes (run on first use)."""
    workdir = tmp_path_factory.mktemp("hf")
    config = llama_config(layers=4)
    config.vocab_size = 256
    config.save_pretrained(str(workdir / "llama"))
    done: dict[int, list[dict]] = {}

    def findings(p: int) -> list[dict]:
        if p not in done:
            done[p] = run_ok(everything_on, p, str(workdir), deadline=420)
        return done[p]

    findings.workdir = workdir
    return findings


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_schedule_leaves_the_one_process_hf_gradients_with_padding_ties_and_dropout(launch, p):
    per_rank = launch(p)
    worst = {case: max(ranks["matrix"][case] for ranks in per_rank) for case in cases_for(p)}
    bad = {case: gap for case, gap in worst.items() if gap > TOLERANCE}
    assert not bad, f"the HF model's gradients differ from one process in {len(bad)} cases: {bad}"


def test_twenty_steps_of_train_model_hf_give_one_loss_curve_on_one_two_and_three_ranks(launch):
    curves = {p: launch(p)[0]["losses"] for p in (1, 2, 3)}
    assert all(len(curve) == 20 for curve in curves.values())
    assert curves[1][-1] < curves[1][0] - 0.2, "the model learns"
    for p in (2, 3):
        gap = max(abs(a - b) / abs(b) for a, b in zip(curves[p], curves[1], strict=True))
        assert gap <= TOLERANCE, f"{p} ranks: the loss curve is {gap:.2e} off one rank's"


def test_two_data_parallel_replicas_of_an_hf_pipeline_follow_the_one_rank_curve(launch):
    """dp 2 x pp 2 for 10 steps: step k's batch depends on (seed, k) alone, so it is the first 10 of 20."""
    one_rank = launch(1)[0]["losses"]
    for kind in ("fsdp", "ddp"):
        curve = launch(4)[0][f"losses {kind}"]
        assert len(curve) == 10
        gap = max(abs(a - b) / abs(b) for a, b in zip(curve, one_rank[:10], strict=True))
        assert gap <= TOLERANCE, f"dp 2 x pp 2 with {kind}: the loss curve is {gap:.2e} off one rank's"


def test_an_exported_checkpoint_loads_in_transformers_with_the_pipelines_validation_loss(launch):
    from transformers import AutoModelForCausalLM

    from pipeclock.app.cli import main
    from pipeclock.app.hf_task import HFTask

    validated = launch(2)[0]["validation"][-1][1]
    out = launch.workdir / "exported"
    assert main(["export", str(launch.workdir / "checkpoints"), "--hf", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    batches = HFTask(training(str(launch.workdir / "llama"), 2)).validation
    with torch.no_grad():
        losses = [model(input_ids=inputs, labels=labels).loss.item() for inputs, labels in batches]
    assert abs(sum(losses) / len(losses) - validated) <= TOLERANCE * validated
    from pipeclock.models import hf

    saved = model.state_dict()
    for stage in range(3):  # the exported directory read back by name, a stage at a time
        for name, parameter in hf.split(str(out), stage, 3).named_parameters():
            assert torch.equal(parameter, saved[name]), name


def test_recompute_on_the_decoder_layers_keeps_the_gradients_and_bf16_stays_near_the_loss(launch):
    features = [ranks["features"] for ranks in launch(2)]
    for name in ("recompute 1f1b", "recompute zb-h1"):
        assert max(found[name] for found in features) <= TOLERANCE, name
    assert features[0]["bf16 loss gap"] <= 1e-2  # bf16 rounding: near, not equal


def test_batches_whose_length_changes_from_step_to_step_give_the_one_process_result():
    outcomes = run_ranks(changing_lengths, 2, deadline=120)
    assert all(outcome.ok for outcome in outcomes), [outcome.error for outcome in outcomes]
    assert max(outcome.value for outcome in outcomes) <= TOLERANCE
