"""Hugging Face causal LMs, unmodified, pipelined: the one-process loss and gradients, on real processes.

GPT-2 (learned positions, a head tied to the embedding, dropout) and Llama (rotary positions,
grouped-query attention, an untied head) from tiny configs, cut by ``hf.split``, with padded batches
(``attention_mask`` and -100 labels): one pipelined step leaves the loss and every gradient within 1e-5
relative of the unmodified HF model on one process called with ``labels=`` on the same weights.

One launch per stage count p in {1, 2, 3, 4}, every schedule in each. A launch costs seconds (each rank
imports transformers), a case a fraction of one: within a launch each schedule runs once, on GPT-2 or
Llama in turn (the other model at the next p), with m taken in turn from {1, p, 2p + 1}; so across the
launches every schedule meets both models and m in {1, p, 2p + 1}. GPT-2 runs with dropout at odd p.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from pipeclock import schedule
from tests.distributed import run_ok
from tests.hf_cases import CONFIGS, gpt2_config, padded_batch, reference, worst_gap

TOLERANCE = 1e-5
SCHEDULE_CHUNKS = {
    "naive": 1,
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "zb-h1": 1,
    "zb-v": 2,
    "dualpipev": 2,
}
PLACEMENT = {"zb-v": "v", "dualpipev": "v"}


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


def hf_cases_on(rank: int, p: int) -> dict[tuple, float]:
    torch.set_num_threads(1)
    return {case: one_case(rank, p, *case) for case in cases_for(p)}


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_schedule_leaves_the_one_process_hf_gradients_with_padding_ties_and_dropout(p):
    per_rank = run_ok(hf_cases_on, p, deadline=420)
    worst = {case: max(results[case] for results in per_rank) for case in cases_for(p)}
    bad = {case: gap for case, gap in worst.items() if gap > TOLERANCE}
    assert not bad, f"the HF model's gradients differ from one process in {len(bad)} cases: {bad}"
