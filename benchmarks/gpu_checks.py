"""The checks of one machine with a GPU, run as a user runs pipeclock, with their figures in one page.

    bash benchmarks/gpu_checks.sh            # finds python (the checkout's .venv, else python3), runs this
    python -m benchmarks.gpu_checks [--out FILE] [--budget SECONDS]

On a machine with a GPU (one rank each, nccl): train the MLP, the GPT in fp32 and bf16, a Hugging Face
Llama of 166M parameters; resume, export and generate from a checkpoint; the planner's memory for that
Llama against the run's CUDA peak (target: within 5 %); two ranks on one GPU (one line, not a
traceback); the engine against a plain PyTorch loop over the same micro-batches (target: at most 1.02 x);
then, with CUDA hidden (``CUDA_VISIBLE_DEVICES=``), the quick gloo sweep of ``benchmarks.run`` and a
four-rank MLP run on the machine's cores. The page goes to ``benchmarks/results/gpu.md``.

Without a GPU the same checks run at toy sizes, the GPU-only ones are listed as skipped, and the page
goes to ``$TMPDIR/pipeclock-gpu-checks-cpu.md`` (the script's own test: ``tests/test_gpu_checks.py``).
Every command has a timeout, and checks past ``--budget`` seconds are skipped, so the whole fits a
device lease.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
LLAMA_166M = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, vocab_size=32000, max_position_embeddings=2048,
                  tie_word_embeddings=False)  # fmt: skip
LLAMA_TOY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
                 tie_word_embeddings=False)  # fmt: skip


@dataclass
class Ran:
    """One command's outcome: its exit code, what it printed, how long it took."""

    code: int | None  # None: stopped at its timeout
    out: str
    err: str
    seconds: float


@dataclass
class Check:
    """A check: the commands it runs, and what it reads from them (``judge``: passed, and the figures)."""

    name: str
    commands: list[list[str]]
    judge: Callable[[list[Ran]], tuple[bool, str]]
    timeout: float = 120.0
    env: dict[str, str] = field(default_factory=dict)


def pipeclock(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeclock", *args]


def module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", name, *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    return module("torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args)


def run(command: list[str], timeout: float, env: dict[str, str]) -> Ran:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = dict(os.environ, PYTHONPATH=path, **env)
    began = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout
        )
        return Ran(done.returncode, done.stdout, done.stderr, time.monotonic() - began)
    except subprocess.TimeoutExpired as expired:
        out, err = (_text(expired.stdout), _text(expired.stderr))
        return Ran(None, out, err, time.monotonic() - began)


def _text(printed: bytes | str | None) -> str:
    return printed.decode() if isinstance(printed, bytes) else printed or ""


# --- reading what a command printed --------------------------------------------------------------------


def found(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text, re.MULTILINE)
    return match.group(1) if match else None


def size_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"([\d.,]+)\s*(\w+)", text.strip()).groups()
    return round(float(number.replace(",", "")) * UNITS[unit])


def last_words(ran: Ran) -> str:
    return (ran.err.strip().splitlines() or ["nothing printed"])[-1][:200]


def trained(ran: list[Ran]) -> tuple[bool, str]:
    """A train run: its final line, step time and CUDA peak."""
    out = ran[0].out
    final = found(r"^(final loss [\d.]+ after \d+ steps)$", out)
    if final is None:
        return False, last_words(ran[0])
    step = found(r"^step time +(\S+ \S+)", out)
    figures = [final, f"step {step}"]
    peak = found(r"CUDA peak ([\d.]+ MiB)", out)
    return ran[0].code == 0, ", ".join(figures + ([f"CUDA peak {peak}"] if peak else []))


def said(pattern: str) -> Callable[[list[Ran]], tuple[bool, str]]:
    """The check passes when the command succeeds and prints a line starting with ``pattern``."""

    def judge(ran: list[Ran]) -> tuple[bool, str]:
        line = found(f"^({pattern}.*)$", ran[0].out + ran[0].err)
        return ran[0].code == 0 and line is not None, (line or last_words(ran[0]))[:200]

    return judge


def resumed(ran: list[Ran]) -> tuple[bool, str]:
    passed, figures = trained(ran)
    line = found(r"^(resum.*)$", ran[0].out + ran[0].err)
    return passed and line is not None, f"{line or 'no resume line'}; {figures}"


def planned(work: Path) -> Callable[[list[Ran]], tuple[bool, str]]:
    """The plan's fullest rank against the Llama run's CUDA peak (kept by that check in ``work``)."""

    def judge(ran: list[Ran]) -> tuple[bool, str]:
        total = found(r"the fullest rank holds .* = ([\d.,]+ \w+) <= ", ran[0].out)
        kept = work / "llama-peak.txt"
        if ran[0].code != 0 or total is None:
            return False, f"no plan: {last_words(ran[0])}"
        if not kept.exists():
            return True, f"planned {total} (no CUDA peak to compare it with here)"
        peak = kept.read_text().strip()
        ratio = size_bytes(total) / size_bytes(peak)
        return abs(
            ratio - 1
        ) <= 0.05, f"planned {total}, the run's CUDA peak {peak}: {ratio:.3f} (target 0.95-1.05)"

    return judge


def against_the_loop(ran: list[Ran]) -> tuple[bool, str]:
    ratio = found(r"^ +pipeclock +\S+ ms +([\d.]+) x the plain loop$", ran[0].out)
    lines = "; ".join(line.strip() for line in ran[0].out.splitlines() if " ms " in line)
    if ran[0].code != 0 or ratio is None:
        return False, last_words(ran[0])
    if not torch.cuda.is_available():
        return True, lines
    return float(ratio) <= 1.02, lines + " (target <= 1.02)"


def refused_gpus(ran: list[Ran]) -> tuple[bool, str]:
    lines = [line for line in ran[0].err.splitlines() if "GPU(s) visible" in line]
    traced = [
        line for line in ran[0].err.splitlines() if line.strip().startswith('File "') and "pipeclock" in line
    ]
    return len(lines) == 2 and not traced, (lines[0] if lines else last_words(ran[0]))[:200]


# --- the checks ---------------------------------------------------------------------------------------


def checks(work: Path, gpu: bool) -> list[Check]:
    """The checks, most important first: a budget that runs out skips the last ones."""
    toy = not gpu
    mlp = ["--hidden", "64", "--layers", "4", "--batch-size", "8"] if toy else []
    gpt = ["--model", "gpt", "--eval-batches", "2"]
    gpt += (
        ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch-size", "4"]
        if toy
        else []
    )
    steps = ["--steps", "3" if toy else "20"]
    llama = ["--hf-config", str(work / "llama.json"), "--microbatches", "2" if toy else "4"]
    llama += ["--seq-len", "16", "--batch-size", "4"] if toy else ["--seq-len", "256", "--batch-size", "8"]
    gpt_run, llama_run = str(work / "gpt"), str(work / "llama")
    tokens = ["--tokens", "20" if toy else "200"]
    plan = ["--stages", "1", "--schedules", "1f1b", "--recompute", "none", "--device-memory", "80GiB"]
    small_loop = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "8"]
    small_loop += ["--steps", "3", "--warmup", "1"]
    found_checks = [
        Check("train: the MLP", [pipeclock("train", *mlp, *steps)], trained),
        Check(
            "train: the GPT, fp32", [pipeclock("train", *gpt, *steps, "--checkpoint-dir", gpt_run)], trained
        ),
        Check("train: the GPT, bf16", [pipeclock("train", *gpt, *steps, "--dtype", "bf16")], trained),
        Check(
            "resume the GPT for five more steps",
            [
                pipeclock(
                    "train", *gpt, "--steps", str(int(steps[1]) + 5), "--checkpoint-dir", gpt_run, "--resume"
                )
            ],
            resumed,
        ),
        Check("export the GPT", [pipeclock("export", gpt_run, str(work / "gpt.pt"))], said("exported ")),
        Check(
            "generate from the GPT",
            [pipeclock("generate", gpt_run, "--prompt", "def ", *tokens, "--temperature", "0")],
            said("# \\d+ bytes from"),
        ),
        Check(
            "train: a Hugging Face Llama" + ("" if toy else " of 166M parameters"),
            [
                pipeclock(
                    "train",
                    "--model",
                    "hf",
                    *llama,
                    "--steps",
                    "2" if toy else "10",
                    "--eval-batches",
                    "1",
                    "--checkpoint-dir",
                    llama_run,
                )
            ],
            trained,
            timeout=240,
        ),
        Check(
            "export the Llama",
            [pipeclock("export", llama_run, "--hf", str(work / "llama-hf"))],
            said("exported "),
        ),
        Check(
            "the planner's memory against that run's CUDA peak",
            [pipeclock("plan", "--model", "hf", *llama, *plan)],
            planned(work),
            timeout=240,
        ),
        Check(
            "the engine against a plain loop over the same micro-batches",
            [module("benchmarks.plain_loop", *(small_loop if toy else []))],
            against_the_loop,
        ),
    ]
    if gpu and torch.cuda.device_count() == 1:
        refused = Check(
            "two ranks on one GPU", [torchrun(2, "-m", "pipeclock", "train", "--steps", "2")], refused_gpus
        )
        found_checks.append(refused)
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    results = str(work if toy else ROOT / "benchmarks" / "results")
    sweep = ["--tiny" if toy else "--quick", "--no-overhead", "--no-figures", "--name", "gpu-machine-gloo"]
    found_checks += [
        Check(
            "CUDA hidden: four ranks of the MLP on gloo",
            [torchrun(4, "-m", "pipeclock", "train", *mlp, *steps)],
            trained,
            env=hidden,
        ),
        Check(
            "CUDA hidden: the quick gloo sweep of benchmarks.run",
            [module("benchmarks.run", *sweep, "--results-dir", results)],
            lambda ran: (
                ran[0].code == 0,
                f"tables in {results}/gpu-machine-gloo.md" if gpu else "toy sizes",
            ),
            timeout=150,
            env=hidden,
        ),
    ]
    return found_checks


# --- the page ------------------------------------------------------------------------------------------


def device_words() -> str:
    if torch.cuda.is_available():
        name, memory = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.device_count()} x {name} ({memory / 2**30:.0f} GiB, sm{major}{minor})"
    return "no GPU (the checks' CPU sizes)"


def versions() -> str:
    try:
        import transformers

        hf = f", transformers {transformers.__version__}"
    except ImportError:
        hf = ", no transformers"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    at = f" at commit {commit.stdout.strip()}" if commit.returncode == 0 else ""
    return f"Python {platform.python_version()}, torch {torch.__version__}{hf}, {os.cpu_count()} cores{at}"


def page(rows: list[tuple[str, str, float, str]], seconds: float) -> str:
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [
        f"# GPU checks: {device_words()}",
        "",
        f"`bash benchmarks/gpu_checks.sh` on {when}; {versions()}; {seconds:.0f} s in all.",
        "",
        "| check | result | seconds | what it printed |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {name} | {result} | {took:.0f} | {said.replace('|', '/')} |" for name, result, took, said in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_checks", description=summary)
    parser.add_argument("--out", type=Path, help="the page (default: benchmarks/results/gpu.md with a GPU)")
    parser.add_argument("--budget", type=float, default=285.0, help="seconds; later checks are skipped")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    cpu_page = Path(tempfile.gettempdir()) / "pipeclock-gpu-checks-cpu.md"
    out = args.out or (ROOT / "benchmarks" / "results" / "gpu.md" if gpu else cpu_page)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipeclock-gpu-checks-") as folder:  # checkpoints, exports
        rows = run_checks(Path(folder), gpu, args.budget)
    if not gpu:
        rows.append(("GPU only: CUDA peaks, the 5 % and 1.02 targets, two ranks on one GPU", "skipped", 0.0,
                     "no GPU here: these wait for one"))  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(rows, time.monotonic() - began))
    print(f"wrote {out}")
    return 0 if all(result in ("passed", "skipped") for _, result, _, _ in rows) else 1


def run_checks(work: Path, gpu: bool, budget: float) -> list[tuple[str, str, float, str]]:
    """Each check's row: its name, passed or not, its seconds, what it printed; skipped past ``budget``."""
    _write_llama(work / "llama.json", LLAMA_166M if gpu else LLAMA_TOY)
    began, rows = time.monotonic(), []
    for check in checks(work, gpu):
        left = budget - (time.monotonic() - began)
        if left < 5:
            rows.append((check.name, "skipped", 0.0, "out of time"))
            continue
        ran = [run(command, min(check.timeout, left), check.env) for command in check.commands]
        passed, text = check.judge(ran)
        result = "passed" if passed else ("timed out" if any(r.code is None for r in ran) else "FAILED")
        rows.append((check.name, result, sum(r.seconds for r in ran), text))
        print(f"{result:>9}  {check.name}: {text}", flush=True)
        peak = found(r"CUDA peak ([\d.]+ MiB)", ran[0].out)
        if check.name.startswith("train: a Hugging Face") and peak:
            (work / "llama-peak.txt").write_text(peak)  # for the planner's check
    return rows


def _write_llama(path: Path, sizes: dict) -> None:
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **sizes}))


if __name__ == "__main__":
    sys.exit(main())
