"""Every causal-LM type of the pinned ``transformers``: exact on 1, 2 and 3 ranks, or refused in one line.

`tools.hf_sweep` builds each type's tiny config with ``transformers`` (a type it cannot build or run at
that size is not swept), and in one launch of 3 processes steps it on 3 ranks (``zb-v``: every piece
alone, split backward), on 2 (``1f1b``) and on 1 (``interleaved-1f1b``, three virtual stages), each rank
comparing its loss and gradients with the model's own forward and backward on the same micro-batches.
Randomness (dropout, LayerDrop, a router's jitter) and the routers' auxiliary loss are on wherever a
family has them. The refused types, with their reasons, are listed in docs/hf/families.md, which the
sweep writes (``python -m tools.hf_sweep --write``).
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from tests.distributed import run_ok
from tools import hf_sweep
from tools.hf_families import causal_lm_types

DEADLINE = 900  # seconds for the whole sweep: several minutes on 2 busy cores
# `make test` leaves it out; `make test-slow` and .ci/run run it
pytestmark = [pytest.mark.long, pytest.mark.timeout(DEADLINE + 60)]


@functools.cache
def swept() -> list[hf_sweep.Outcome]:
    per_rank = run_ok(hf_sweep.rank_sweep, hf_sweep.WORLD, causal_lm_types(), timeout=300, deadline=DEADLINE)
    return hf_sweep.merged(per_rank)


def test_every_causal_lm_type_is_exact_or_refused_in_one_line():
    outcomes = swept()
    assert len(outcomes) == len(causal_lm_types()), "the sweep stopped at a failure"
    failed = {o.model_type: o.detail for o in outcomes if o.kind not in ("exact", "refused", "not built")}
    assert not failed, f"{len(failed)} types neither exact nor refused: {failed}"
    exact = [o for o in outcomes if o.kind == "exact"]
    assert all(len(o.gaps) == 2 * hf_sweep.WORLD for o in exact), "every rank ran its two steps"
    assert max(o.worst for o in exact) <= hf_sweep.TOLERANCE
    for refused in (o for o in outcomes if o.kind == "refused"):
        assert "\n" not in refused.detail and refused.detail, refused.model_type


def test_the_docs_list_the_refused_types_and_their_reasons_as_the_sweep_finds_them():
    page = hf_sweep.DOCS.read_text()
    assert hf_sweep.page_table(page) == hf_sweep.table(swept()), (
        "docs/hf/families.md is out of date: python -m tools.hf_sweep --write"
    )
