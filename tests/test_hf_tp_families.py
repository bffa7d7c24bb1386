"""Every causal-LM type with a tp plan in the pinned ``transformers``: exact at tp 2 and at pp 2 × tp 2, or
refused in one line.

`tools.hf_tp_sweep` builds each type's tiny config (randomness on) with ``transformers`` as the reference,
splits it over two ranks by the plan ``transformers`` itself would apply (and over four: two stages, each
split so), and steps it (two micro-batches), each rank comparing its loss and every gradient (gathered
whole) with the model's own forward and backward.
docs/hf/families.md lists what it finds (``python -m tools.hf_tp_sweep --write``).
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from tests.distributed import run_ok
from tools import hf_sweep, hf_tp_sweep
from tools.hf_families import causal_lm_types

DEADLINE = 3000  # seconds for each layout's sweep on 2 busy cores
pytestmark = [pytest.mark.long, pytest.mark.timeout(2 * DEADLINE + 60)]


@functools.cache
def swept() -> dict[str, list[hf_sweep.Outcome]]:
    return {
        layout: hf_sweep.merged(
            run_ok(hf_tp_sweep.rank_sweep, world, causal_lm_types(), timeout=300, deadline=DEADLINE)
        )
        for world, layout in hf_tp_sweep.LAYOUTS.items()
    }


def test_every_type_with_a_tp_plan_is_exact_at_tp2_and_pp2_x_tp2_or_refused_in_one_line():
    for layout, outcomes in swept().items():
        failed = {o.model_type: o.detail for o in outcomes if o.kind not in ("exact", "refused", "not built")}
        assert not failed, f"{len(failed)} types neither exact nor refused at {layout}: {failed}"
        for o in (o for o in outcomes if o.kind == "exact"):
            assert o.worst <= hf_tp_sweep.LOOSER.get(o.model_type, hf_sweep.TOLERANCE), (layout, o.model_type)
        for refused in (o for o in outcomes if o.kind == "refused"):
            assert "\n" not in refused.detail and refused.detail, (layout, refused.model_type)


def test_the_docs_list_every_type_at_tp2_and_pp2_x_tp2_as_the_sweep_finds_it():
    page = hf_sweep.DOCS.read_text()
    assert hf_tp_sweep.page_table(page) == hf_tp_sweep.table(swept()), (
        "docs/hf/families.md is out of date: python -m tools.hf_tp_sweep --write"
    )
