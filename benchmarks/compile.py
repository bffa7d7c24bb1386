"""``train --compile`` against eager: the step time of compiled blocks, and what compiling costs once.

    python -m benchmarks.compile              # GPT and a Llama-like HF model, 1 and 2 stages; writes
                                              # benchmarks/results/compile.json and compile.md
    python -m benchmarks.compile --steps 8    # fewer steps, a quick look

Each case is the main job as a user runs it (``train``, 1F1B, 8 micro-batches, no validation), once eager
and once with ``--compile``, on 1 process and under torchrun on 2 (one stage each). A step's time is rank
0's (``StepRecord.seconds``; the pipeline's last rank finishes with it). The first steps warm up
(compiling, with ``--compile``) and are reported apart; the figure is the median of the later steps.
Inductor's cache is emptied before each compiled run (a fresh ``TORCHINDUCTOR_CACHE_DIR``), so the first
step pays the whole compilation, as on a fresh machine. Both runs' losses are recorded and compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.launch import ROOT, torchrun

RESULTS = ROOT / "benchmarks" / "results"
WARMUP = 2
GPT = ["--model", "gpt", "--layers", "4", "--dim", "256", "--heads", "4", "--seq-len", "128"]
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
    "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 512, "max_position_embeddings": 256,
}  # fmt: skip
COMMON = ["--batch-size", "16", "--microbatches", "8", "--eval-every", "0", "--eval-batches", "1"]


def worker(argv: list[str]) -> None:
    """One run on this rank; rank 0 writes its steps' seconds and losses to the file ``argv[0]`` names."""
    from pipeclock import comms
    from pipeclock.cli.commands import train as command
    from pipeclock.training.loop import TrainConfig, train

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out, args = argv[0], parser.parse_args(argv[1:])
    result = train(TrainConfig.from_args(args))
    if comms.get_rank() == 0:
        seconds = [record.seconds for record in result.records]
        Path(out).write_text(json.dumps({"seconds": seconds, "losses": result.losses}))
    comms.shutdown()


def run_case(model: list[str], stages: int, compiled: bool, steps: int, scratch: Path) -> dict:
    out = scratch / f"{len(os.listdir(scratch))}.json"
    args = [str(out), *model, *COMMON, "--steps", str(steps), *(["--compile"] if compiled else [])]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=scratch)
    if stages == 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        import subprocess

        subprocess.run([sys.executable, "-m", "benchmarks.compile", "--worker", *args], check=True, cwd=ROOT)
    else:
        torchrun("benchmarks.compile", stages, ["--worker", *args], timeout=1800)
    found = json.loads(out.read_text())
    later = found["seconds"][WARMUP:]
    return {
        "first_steps_s": found["seconds"][:WARMUP],
        "median_step_s": statistics.median(later),
        "losses": found["losses"],
    }


def table(records: list[dict]) -> str:
    lines = [
        "| model | stages | eager step (s) | compiled step (s) | speed-up | compiled first step (s) | "
        "losses equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        eager, compiled = r["eager"], r["compiled"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"], strict=True))
        equal = "bit for bit" if worst == 0 else f"rel {worst:.1e}"
        before, after = eager["median_step_s"], compiled["median_step_s"]
        lines.append(
            f"| {r['model']} | {r['stages']} | {before:.3f} | {after:.3f} | {before / after:.2f}x | "
            f"{compiled['first_steps_s'][0]:.1f} | {equal} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(RESULTS / "compile.json"))
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="compile-bench-"))
    llama = scratch / "llama.json"
    llama.write_text(json.dumps(LLAMA))
    models = {
        "GPT 4 x 256": GPT,
        "Llama 4 x 256": ["--model", "hf", "--hf-config", str(llama), "--seq-len", "128"],
    }
    records = []
    for name, model in models.items():
        for stages in (1, 2):
            runs = {kind: run_case(model, stages, kind == "compiled", args.steps, scratch) for kind in
                    ("eager", "compiled")}  # fmt: skip
            records.append({"model": name, "stages": stages, **runs})
            print(table(records[-1:]).splitlines()[-1], flush=True)
    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    Path(args.out).with_suffix(".md").write_text(table(records) + "\n")
    print(table(records))


if __name__ == "__main__":
    main()
