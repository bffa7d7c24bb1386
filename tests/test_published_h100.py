"""The cluster planner held to Meta's and NVIDIA's published H100 runs (`benchmarks.published_h100`):
each row's own knobs, with the micro-batch and recompute the search picks for it fixed so that each
judgement is quick. The fp8 rows fitted ``H100_FP8_GEMM_EFFICIENCY`` are marked; the others only check."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from benchmarks.cluster_check import errors, predict
from benchmarks.published_h100 import BRIDGE, META, NEMO, rows
from pipeclock.cli.plan_cluster import parse_fix

pytestmark = pytest.mark.long  # ~15 s: transformers' configs, then twelve judgements of a second or so

# what the search picks for each row's free knobs (python -m benchmarks.cluster_check); not GPT3-5B, whose
# predicted compute alone is 14 % under the published step (docs/cluster.md, on all of a node's NICs)
PICKED = {
    "Llama 3 405B, 8,192 GPUs": "microbatch-size=1,chunks=4,sp=on",
    "Llama 3 405B, 16,384 GPUs": "microbatch-size=1,chunks=4,sp=on",
    "GPT3-20B, 64 GPUs": "recompute=selective-op,zero=1,sp=on",
    "GPT3-175B, 128 GPUs": "recompute=none,zero=1,sp=on",
    "LLAMA2-7B, 8 GPUs": "recompute=none,zero=3",
    "LLAMA2-13B, 16 GPUs": "recompute=none,zero=1",
    "LLAMA2-70B, 64 GPUs": "recompute=none,zero=1,sp=on",
    "Llama 3 8B, 8 GPUs, GBS 128 (25.11)": "recompute=none",
}


@pytest.fixture(scope="module")
def table() -> dict:
    return {row.name: row for row in rows()}


def judged(row, extra: str):
    row = dataclasses.replace(row, fixed=row.fixed | parse_fix(extra))
    row.predicted = predict(row)
    return row


@pytest.mark.parametrize("name", sorted(PICKED))
def test_a_published_h100_run_is_predicted_within_10_percent(table, name):
    row = judged(table[name], PICKED[name])
    speed, _ = errors(row)
    assert abs(speed) <= 0.10, (row.source, name, f"{speed:+.1%}")


def test_every_published_h100_row_is_in_the_table_or_listed_as_not_modelled(table):
    assert {row.source for row in table.values()} == {META, NEMO, BRIDGE}
    assert len(table) == 12 and set(PICKED) <= set(table)


@pytest.mark.parametrize(
    "name",
    ["GPT3-175B, 512 GPUs", "Llama 3 70B, 64 GPUs, GBS 128 (25.11)", "Llama 3 70B, 64 GPUs, GBS 256 (26.04)"],
)
def test_megatron_fp8_runs_out_of_10_percent_are_off_by_the_memory_judged_not_the_speed(table, name):
    """Their published layouts without recompute are judged over 80 GiB (docs/cluster.md says what the
    planner's memory does not know of them), so the search recomputes; run as published, within 10 %."""
    row = judged(table[name], "recompute=none,zero=1")
    assert not row.predicted["fits"] and abs(errors(row)[0]) <= 0.10
