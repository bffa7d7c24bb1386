"""``plan --cluster``: the answers it prints, its JSON, and its refusals (one line each, exit code 2)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from pipeclock.cli.dispatch import main

pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parent.parent / "docs" / "cluster"
LLAMA_405B = str(CONFIGS / "llama-3.1-405b.json")
LLAMA_70B = str(CONFIGS / "llama-3.1-70b.json")


def plan(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["pipeclock", "plan"])
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    # a search past a second (a loaded machine) reports its progress on stderr: not what these tests hold
    err = "".join(line for line in err.splitlines(True) if not line.startswith("pipeclock plan: searching:"))
    return code, out, err


def test_the_seeds_question_on_four_rtx4090s_tells_the_memory_wall_in_numbers(monkeypatch, capsys):
    code, out, err = plan(monkeypatch, capsys, "--cluster", "4xRTX4090", "--params", "10e9")
    assert (code, err) == (1, "")
    assert "nothing fits on 4xRTX4090 (96 GiB in all):" in out
    assert "10B x 18 B = 180 GB" in out and "alone take 37.3 GiB per GPU, against 24 GiB" in out
    assert "the fewest RTX4090 that fit: " in out and "the largest model of this shape that fits" in out


def test_the_follow_ups_of_a_plan_that_fits_nowhere_keep_its_fix(monkeypatch, capsys):
    code, out, err = plan(monkeypatch, capsys, "--cluster", "8xRTX4090", "--params", "10e9", "--fix", "pp=4")
    assert (code, err) == (1, "")
    fewest = re.search(r"^the fewest RTX4090 that fit with pp=4 fixed: \d+, best as (.*)$", out, re.M)
    largest = re.search(
        r"^the largest model .* on 8xRTX4090 with pp=4 fixed: about ([\d.]+)B .*, as (.*)$", out, re.M
    )
    assert " pp 4 " in fewest[1] and " pp 4 " in largest[2], "the fix holds in both"
    assert float(largest[1]) < 10, "10B does not fit with pp 4 on 8 cards"


def test_a_405b_config_plans_here_and_fix_prints_one_json_object_with_the_fixed_knobs(monkeypatch, capsys):
    code, out, err = plan(
        monkeypatch, capsys, "--cluster", "512xH100-80GB", "--hf-config", LLAMA_405B, "--global-batch", "256",
        "--seq-len", "8192", "--fix", "tp=8,pp=8,schedule=1f1b,recompute=full", "--json",
    )  # fmt: skip
    assert (code, err) == (0, "")
    answer = json.loads(out)
    assert (answer["tp"], answer["pp"], answer["dp"]) == (8, 8, 8)
    assert (answer["schedule"], answer["recompute"]) == ("1f1b", "full")
    assert answer["fits"] and answer["memory_per_gpu_bytes"] <= 80 * 2**30
    for field in ("tokens_per_second_per_gpu", "tflops_per_gpu", "mfu", "step_seconds", "microbatch_size"):
        assert answer[field] > 0
    tokens = 256 * 8192 / answer["step_seconds"] / 512
    assert answer["tokens_per_second_per_gpu"] == pytest.approx(tokens, rel=1e-3)


def test_fp8_keeps_says_what_an_fp8_runs_products_keep(monkeypatch, capsys):
    """Transformer Engine's fp8 inputs make a layout lighter than torchao's bf16 ones; its fp8 weight
    copies beside bf16 weights make it heavier than fp8 weights do."""
    memory = {}
    for keeps in ("torchao", "te", "te-fp8-params"):
        code, out, err = plan(
            monkeypatch, capsys, "--cluster", "64xH100-80GB", "--hf-config", LLAMA_70B,
            "--global-batch", "128", "--seq-len", "8192", "--dtype", "fp8", "--fp8-keeps", keeps, "--fused",
            "--fix", "tp=4,pp=8,dp=2,schedule=interleaved-1f1b,chunks=5,recompute=none,zero=1,sp=on,"
            "microbatch-size=1", "--json",
        )  # fmt: skip
        answer = json.loads(out)
        assert (code, err) == (0 if answer["fits"] else 1, "")
        memory[keeps] = answer["memory_per_gpu_bytes"]
    assert memory["te-fp8-params"] <= 80 * 2**30 < memory["torchao"]  # Megatron-Bridge's recipe, as run
    assert memory["te-fp8-params"] < memory["te"]


def test_attention_without_a_flash_kernel_is_a_flag_that_slows_the_same_configuration(monkeypatch, capsys):
    job = ["--cluster", "8xA100-80GB", "--model", "gpt", "--dim", "2048", "--layers", "8", "--heads", "16",
           "--seq-len", "2048", "--global-batch", "64"]  # fmt: skip
    fixed = ["--fix", "tp=2,pp=2,dp=2,schedule=1f1b,microbatch-size=1,recompute=none,zero=1,sp=off", "--json"]
    steps = {}
    for kernel in ("flash", "materialized"):
        code, out, err = plan(monkeypatch, capsys, *job, *fixed, "--attention", kernel)
        assert (code, err) == (0, "")
        steps[kernel] = json.loads(out)["step_seconds"]
    assert steps["materialized"] > steps["flash"]  # the score matrix's trips through memory
    code, out, _ = plan(monkeypatch, capsys, *job, "--attention", "materialized", "--top", "1")
    assert code == 0 and "attention's scores materialized" in out.splitlines()[0]


def test_a_fixed_v_schedule_is_searched_over_the_layouts_with_a_pipeline(monkeypatch, capsys):
    model = ["--model", "gpt", "--dim", "1024", "--layers", "8", "--heads", "16"]
    code, out, err = plan(
        monkeypatch, capsys, "--cluster", "8xH100-80GB", *model, "--fix", "schedule=dualpipev", "--json"
    )
    assert (code, err) == (0, "")
    answer = json.loads(out)
    assert answer["schedule"] == "dualpipev" and answer["pp"] >= 2


def test_the_search_prints_its_ranking_and_why_the_best_wins(monkeypatch, capsys):
    code, out, err = plan(
        monkeypatch, capsys, "--cluster", "16xH100-80GB", "--model", "gpt", "--dim", "2048", "--layers", "16",
        "--heads", "16", "--vocab", "32000", "--seq-len", "2048", "--global-batch", "64", "--top", "3",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert "GPT 16 blocks x 2048" in out and "tokens/s/GPU" in out
    assert out.count("\n1  ") == 1 and "\n3  " in out and "\n4  " not in out
    assert "\nwhy: " in out and "memory of the fullest GPU: weights" in out


def test_a_gpu_spec_file_describes_any_other_kind(monkeypatch, capsys, tmp_path):
    spec = json.loads((CONFIGS / "h100-96gb-500w.json").read_text())
    (tmp_path / "gpu.json").write_text(json.dumps(spec | {"name": "MyGPU", "memory_gb": 40}))
    spec_file = str(tmp_path / "gpu.json")
    code, out, err = plan(
        monkeypatch, capsys, "--cluster", "8xMyGPU", "--gpu-spec", spec_file, "--params", "1e9", "--json"
    )
    assert (code, err) == (0, "")
    assert all(row["memory_per_gpu_bytes"] <= 40 * 2**30 for row in json.loads(out))


def test_a_spec_may_give_its_fp8_products_their_own_share_of_the_fp8_peak(tmp_path):
    from pipeclock.plan.cluster_config import Software
    from pipeclock.plan.cluster_time import Rates
    from pipeclock.plan.gpus import KINDS, load_spec

    own = load_spec(_spec_with(tmp_path, "fp8_gemm_efficiency", "0.5"))
    assert Rates(own, Software("fp8")).gemm == pytest.approx(own.fp8_flops * 0.5)
    titan = load_spec(CONFIGS / "h100-96gb-500w.json")  # none of its own: its bf16 share x FP8_SHARE
    assert titan.fp8_gemm_efficiency is None
    h100 = KINDS["H100-80GB"]
    assert Rates(h100, Software("fp8")).gemm == pytest.approx(h100.fp8_flops * h100.fp8_gemm_efficiency)


def _spec_with(tmp_path, field: str, raw: str) -> str:
    """The spec with ``field`` written as the JSON text ``raw`` (NaN and 1e400 are what a user types)."""
    spec = json.loads((CONFIGS / "h100-96gb-500w.json").read_text())
    spec[field] = "RAW"
    (tmp_path / "gpu.json").write_text(json.dumps(spec).replace('"RAW"', raw))
    return str(tmp_path / "gpu.json")


def _config(tmp_path, kind: str) -> str:
    """A BERT config (an encoder), a Llama whose 3 heads do not divide its width of 100, DeepSeek-V3
    routing each token to more experts than it has, or a Doge (a causal LM whose shapes the planner does
    not read)."""
    sizes = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128}
    if kind == "EXPERTS":
        sizes = json.loads((CONFIGS / "deepseek-v3.json").read_text()) | {"num_experts_per_tok": 300}
    elif kind == "HEADS":
        sizes |= {"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3, "vocab_size": 1000}
    else:
        sizes |= {"model_type": "doge" if kind == "DOGE" else "bert"}
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    return str(tmp_path)


def test_a_fixed_interleaving_takes_any_chunk_count_that_fits_the_layers(monkeypatch, capsys):
    code, out, err = plan(
        monkeypatch, capsys, "--cluster", "64xH100-80GB", "--hf-config", str(CONFIGS / "llama-3.1-70b.json"),
        "--global-batch", "128", "--fix", "tp=8,pp=4,chunks=5,schedule=interleaved-1f1b", "--json",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert json.loads(out)["chunks"] == 5


def test_a_gpu_whose_memory_the_runtime_fills_is_answered_at_once(monkeypatch, capsys, tmp_path):
    """No count of 1 GB cards fits anything (the runtime's allowance alone is 2 GiB): no search for the
    fewest that fit."""
    code, out, err = plan(
        monkeypatch, capsys, "--cluster", "8xH100-96GB-500W", "--params", "1e9",
        "--gpu-spec", _spec_with(tmp_path, "memory_gb", "1"),
    )  # fmt: skip
    assert (code, err) == (1, "") and "nothing fits" in out and "the fewest" not in out


def _spec_without(tmp_path, field: str) -> str:
    spec = json.loads((CONFIGS / "h100-96gb-500w.json").read_text())
    del spec[field]
    (tmp_path / "gpu.json").write_text(json.dumps(spec))
    return str(tmp_path / "gpu.json")


def _t5_config(tmp_path) -> str:
    from transformers import T5Config

    T5Config(d_model=64, num_layers=2).save_pretrained(str(tmp_path))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cluster", "8xB300"], "unknown GPU kind 'B300': known kinds are A100-40GB, A100-80GB, H100-80GB"),
        (["--cluster", "eight H100s"], "--cluster takes N x KIND"),
        (["--cluster", "0xH100-80GB", "--params", "1e9"], "--cluster needs at least one GPU, got '0xH100"),
        (["--cluster", "8xH100-80GB", "--hf-config", LLAMA_405B, "--params", "1e9"],
         "--params and --hf-config each give the model: use one"),
        (["--params", "1e9", "--model", "gpt"], "--params and --model gpt each give the model: use one"),
        (["--cluster", "8xH100-80GB", "--gpu-spec", "SPEC-NO-MEMORY"], "lacks memory_gb"),
        (["--cluster", "8xH100-80GB", "--gpu-spec", "/nowhere.json"], "/nowhere.json: no such file"),
        (["--cluster", "16384xH100-80GB", "--hf-config", LLAMA_405B, "--global-batch", "7"],
         "no dp x m divides --global-batch 7"),
        (["--cluster", "32xH100-80GB", "--hf-config", LLAMA_405B, "--fix", "tp=16"],
         "--fix tp=16 is more than the 8 GPUs of one H100-80GB node"),
        (["--cluster", "256xH100-80GB", "--hf-config", LLAMA_405B, "--fix", "pp=128"],
         "--fix pp=128 is more than the model's 126 layers"),
        (["--cluster", "512xH100-80GB", "--hf-config", LLAMA_405B, "--fix", "tp=8,pp=8,dp=4"],
         "--fix tp x pp x dp = 8 x 8 x 4 = 256, not the cluster's 512 GPUs"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--fix", "speed=2"], "--fix takes KNOB=VALUE pairs"),
        (["--cluster", "8xH100-80GB", "--hf-config", "T5"], "T5Config (model_type 't5') is not a causal"),
        (["--cluster", "8xA100-80GB", "--params", "1e9", "--dtype", "fp8"], "A100-80GB has no fp8 tensor"),
        (["--params", "1e9", "--fix", "tp=2"], "--fix plans a cluster on paper: give --cluster NxKIND too"),
        (["--params", "1e9", "--gradients", "bf16+fp32"], "--gradients plans a cluster on paper"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--gradients", "fp16"],
         "argument --gradients: invalid choice: 'fp16' (choose from 'fp32', 'bf16+fp32')"),
        (["--params", "1e9", "--tp-backward-overlap"], "--tp-backward-overlap plans a cluster on paper"),
        (["--params", "1e9", "--deepspeed"], "--deepspeed plans a cluster on paper"),
        (["--params", "1e9", "--fp8-keeps", "te"], "--fp8-keeps plans a cluster on paper"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--fp8-keeps", "te"],
         "--fp8-keeps says what fp8 products keep: give --dtype fp8 too"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--dtype", "fp8", "--fp8-keeps", "fp4"],
         "argument --fp8-keeps: invalid choice: 'fp4'"),
        (["--params", "1e9", "--attention", "materialized"], "--attention plans a cluster on paper"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--rank-order", "tp-pp-dp"],
         "argument --rank-order: invalid choice: 'tp-pp-dp' (choose from 'dp-pp-tp', 'pp-dp-tp')"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--fix", "schedule=zb-v,pp=1"],
         "--fix schedule=zb-v folds the model over the pipeline's ranks: not with pp=1"),
        (["--cluster", "8xA100-80GB", "--params", "1e9", "--attention", "eager"],
         "argument --attention: invalid choice: 'eager' (choose from 'flash', 'materialized')"),
        (["--cluster", "8xH100-80GB", "--gpu-spec", "SPEC memory_gb NaN"],
         "memory_gb must be a finite number above 0, got nan"),
        (["--cluster", "8xH100-80GB", "--gpu-spec", "SPEC memory_gb 1e400"],
         "memory_gb must be a finite number above 0, got inf"),
        (["--cluster", "8xH100-80GB", "--gpu-spec", "SPEC gemm_eficiency 0.5"],
         "unknown field gemm_eficiency (did you mean gemm_efficiency?)"),
        (["--cluster", "8xH100-80GB", "--gpu-spec", "SPEC fp8_gemm_efficiency -1"],
         "fp8_gemm_efficiency must be a finite number above 0, got -1"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--fix", "tp=8,tp=2"], "--fix names tp twice"),
        (["--cluster", "8xH100-80GB", "--hf-config", "BERT"], "BertConfig (model_type 'bert') is not a"),
        (["--cluster", "8xH100-80GB", "--hf-config", "DOGE"],
         "DogeConfig (model_type 'doge'): plan --hf-config does not read this family's shapes"),
        (["--cluster", "8xH100-80GB", "--hf-config", "HEADS"], "hidden size (100) is not a multiple of the"),
        (["--cluster", "8xH100-80GB", "--hf-config", "EXPERTS"],
         "deepseek_v3 config routes each token to num_experts_per_tok = 300 of its 256 experts"),
        (["--cluster", "64xH100-80GB", "--hf-config", LLAMA_405B, "--fix", "pp=32,chunks=5"],
         "--fix pp=32 x chunks=5 is 160 virtual stages, more than the model's 126 layers"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--fix", "ends=first"],
         "--fix ends=first: use ride (the embedding and the head with the first and last blocks) or slot"),
        (["--cluster", "64xH100-80GB", "--hf-config", LLAMA_405B, "--fix", "pp=16,chunks=9,ends=slot"],
         "--fix pp=16 x chunks=9 is 144 virtual stages, more than the model's 126 layers and its two ends"),
        (["--cluster", "8xH100-80GB", "--params", "1e9", "--fix", "recompute=selective"],
         "--fix recompute=selective is two policies now: selective-attention (Megatron-LM's"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_code_2(monkeypatch, capsys, tmp_path, args, message):
    args = [_spec_without(tmp_path, "memory_gb") if a == "SPEC-NO-MEMORY" else a for a in args]
    args = [_t5_config(tmp_path) if a == "T5" else a for a in args]
    args = [_spec_with(tmp_path, *a.split()[1:]) if a.startswith("SPEC ") else a for a in args]
    args = [_config(tmp_path, a) if a in ("BERT", "HEADS", "DOGE", "EXPERTS") else a for a in args]
    code, out, err = plan(monkeypatch, capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("pipeclock plan: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_long_search_shows_one_progress_line_off_a_terminal_and_none_in_its_first_second():
    import io

    from pipeclock.cli.search_progress import SearchProgress

    stream = io.StringIO()
    progress = SearchProgress(stream)
    progress(4096, 0, None)
    assert stream.getvalue() == ""  # within the first second: nothing
    progress.started -= 2.0
    progress(8192, 3, 12.5)
    progress.shown -= 1.0
    progress(8192, 9, 11.0)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines == [
        "pipeclock plan: searching: 8,192 configurations considered, 3 judged, best step so far 12.5 s ..."
    ]


def test_the_why_line_gives_the_bubble_the_table_shows(monkeypatch, capsys):
    """torchtitan's 1F1B run of lab 13: 8 micro-batches through 8 stages idle 7/15 of the step, and the
    line that names the bubble says so, though the step's collectives overlap its compute."""
    spec = str(CONFIGS / "h100-96gb-500w.json")
    fix = "dp=8,tp=8,pp=8,zero=3,microbatch-size=4,recompute=full,sp=on,schedule=1f1b"
    code, out, err = plan(
        monkeypatch, capsys, "--cluster", "512xH100-96GB-500W", "--gpu-spec", spec, "--hf-config", LLAMA_405B,
        "--global-batch", "256", "--seq-len", "8192", "--dtype", "fp8", "--fused", "--tp-overlap",
        "--fix", fix,
    )  # fmt: skip
    assert (code, err) == (0, "")
    table = float(re.search(r" s\s+(\d+\.\d)%\s+tp 8", out).group(1))
    said = int(re.search(r"the bubble \((\d+)% of the step\)", out).group(1))
    assert said == round(table) == 47
    assert "searched 1 configuration in" in out  # one, not "1 configurations"


def test_a_rate_of_ten_thousand_or_more_prints_whole_not_as_an_exponent(monkeypatch, capsys):
    code, out, err = plan(
        monkeypatch, capsys, "--cluster", "256xH100-80GB", "--model", "gpt", "--dim", "4096",
        "--layers", "32", "--heads", "32", "--vocab", "50304", "--seq-len", "2048", "--global-batch", "1024",
        "--top", "1",
    )  # fmt: skip
    assert (code, err) == (0, "")
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    assert "e+" not in row and re.match(r"1\s+\d{2},\d{3}\s", row), row
