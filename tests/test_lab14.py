"""Lab 14, experts across ranks: its four parts say what the library computes, in one process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

LAB = Path(__file__).resolve().parent.parent / "labs" / "14_experts.py"


def lab():
    spec = importlib.util.spec_from_file_location("lab14", LAB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.long  # docs/lab14-experts.md's quoted run (tests/test_docs.py) holds the same output
def test_lab14_routes_counts_the_bytes_divides_the_memory_and_shows_the_overlap(capsys, monkeypatch):
    monkeypatch.chdir(LAB.parent.parent)
    module = lab()
    module.main([])
    out = capsys.readouterr().out
    # part 1 and 2: every copy is counted once, from its token's rank to its expert's
    assert "of 24 copies, 13 leave their rank: 3,328 B each way" in out
    # part 3: the layer's experts halved by ep 2; DeepSeek-V3 fits an 80 GB GPU with ep 64 only
    assert (
        "without ep: every rank holds all 8: 3,072 KiB" in out
        and "with ep 2: each rank holds 4: 1,536 KiB" in out
    )
    assert "ep 64  weights, gradients and optimizer state   20.4 GiB, in all   65.3 GiB" in out
    # part 4: the simulator hides none under 1F1B, most under DualPipeV
    assert (
        "1f1b       all-to-all  64.0, hidden   0.0%" in out
        and "dualpipev  all-to-all  64.0, hidden  69.5%" in out
    )


def test_lab14_counts_match_the_routers_choice_for_any_ep(capsys, monkeypatch):
    monkeypatch.chdir(LAB.parent.parent)
    module = lab()
    args = module.parse_args(["--ep", "4", "--tokens", "3"])
    chosen = module.routing(args, module.moe_block(args.seed))
    capsys.readouterr()
    module.exchange(args, chosen)
    out = capsys.readouterr().out
    away = sum(token // 3 != expert // 2 for token, row in enumerate(chosen.tolist()) for expert in row)
    assert f"of 24 copies, {away} leave their rank: {away * 256:,} B each way" in out


def test_lab14_refuses_an_ep_that_does_not_divide_the_experts_in_one_line(capsys):
    module = lab()
    with pytest.raises(SystemExit) as raised:
        module.main(["--ep", "3"])
    assert raised.value.code == 2
    assert capsys.readouterr().err == "lab 14: error: --ep 3 does not divide the layer's 8 experts\n"
