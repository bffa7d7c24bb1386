"""How fast the cluster planner answers: the program simulator on a long interleaved step, and the searches
a user runs (405B on 16,384 GPUs, a 1T GPT on 3,072, a GPT-shaped free search, a --fix pp=64 judgement,
DeepSeek-V3's free mixture-of-experts search on 2,048 H800s).

    python -m benchmarks.cluster_speed        # prints a table, writes benchmarks/results/cluster_speed.*

Each figure is the least of ``--repeats`` runs (a shared machine only ever adds time), as wall time and as
this process's CPU time, with the machine's load average beside them. The simulator's figure is one
whole pass, as the planner makes it: generate the schedule, lower it to its program, simulate it. The
search's starts from empty caches, as a fresh ``plan --cluster`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from pipeclock.engine.generators import generate
from pipeclock.engine.program import lower
from pipeclock.engine.program_run import simulate_program

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = Path(__file__).resolve().parent.parent / "docs" / "cluster"
LLAMA_405B = CONFIGS / "llama-3.1-405b.json"
SIMULATIONS = [("interleaved-1f1b", 16, 256, 2), ("interleaved-1f1b", 16, 256, 4), ("1f1b", 16, 256, 1),
               ("zb-v", 16, 256, 2), ("dualpipev", 16, 256, 2)]  # fmt: skip


def timed(work, repeats: int) -> tuple[float, float]:
    """(least wall seconds, least CPU seconds) of ``repeats`` runs of ``work``."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def simulate_once(schedule: str, p: int, m: int, chunks: int) -> None:
    simulate_program(lower(generate(schedule, p, m, chunks)), lambda _rank, _instruction: 1.0)


# (what, how the model is made, GPUs, kind, global batch, seq len, --fix): each a search a user runs; a kind
# ending in .json is a --gpu-spec file under docs/cluster, and DeepSeek-V3 plans in fp8 as it trained
SEARCHES = [
    ("search: Llama 3.1 405B (its config.json), 16384 x H100-80GB, 1024 x 8192 tokens",
     "llama-405b", 16384, "H100-80GB", 1024, 8192, {}),
    ("search: GPT 1T (128 x 25600, 160 heads), 3072 x A100-80GB, 3072 x 2048 tokens",
     "gpt-1t", 3072, "A100-80GB", 3072, 2048, {}),
    ("search: GPT 6.7B-shaped (32 x 4096), 256 x H100-80GB, 1024 x 2048 tokens",
     "gpt-6.7b", 256, "H100-80GB", 1024, 2048, {}),
    ("--fix pp=64: GPT 1T, 3072 x A100-80GB, 3072 x 2048 tokens",
     "gpt-1t", 3072, "A100-80GB", 3072, 2048, {"pp": 64}),
    ("search: DeepSeek-V3 (its config.json, MoE, fp8, fused), 2048 x H800, 15360 x 4096 tokens "
     "(docs/cluster.md's free DeepSeek-V3 command)", "deepseek-v3", 2048, "h800.json", 15360, 4096, {}),
]  # fmt: skip


def _model(which: str):
    from pipeclock.plan.hf_paper import paper_model, read_config
    from pipeclock.plan.paper_model import gpt_model

    if which == "llama-405b":
        return paper_model(read_config(LLAMA_405B))
    if which == "deepseek-v3":
        return paper_model(read_config(CONFIGS / "deepseek-v3.json"), "DeepSeek-V3")
    if which == "gpt-1t":
        return gpt_model(25600, 128, 160, 51200)
    return gpt_model(4096, 32, 32, 50304)


def search_once(which: str, gpus: int, kind: str, batch: int, seq: int, fixed: dict) -> dict:
    """One search from empty caches, the model read as ``plan`` reads it (its config file included; the
    first read of a config imports transformers, which the least of several runs leaves out)."""
    from pipeclock.plan.cluster_config import Job, Software
    from pipeclock.plan.gpus import KINDS, Cluster, load_spec
    from pipeclock.plan.search import search

    model = _model(which)
    clear_caches()
    gpu = load_spec(CONFIGS / kind) if kind.endswith(".json") else KINDS[kind]
    software = Software("fp8", True, False) if which == "deepseek-v3" else Software("bf16")
    found = search(model, Cluster(gpus, gpu), Job(batch, seq), software, fixed, top=1 if fixed else 5)
    best = found.ranked[0]
    return {
        "considered": found.considered, "judged": found.judged, "simulated": found.simulated,
        "best": best.config.label(), "tokens_per_second_per_gpu": round(best.tokens_per_second_per_gpu, 1),
    }  # fmt: skip


def clear_caches() -> None:
    """Empty every cache pipeclock keeps (functions', methods', and the floors' tables), as a fresh
    process starts: a search must not be timed on what the previous run left."""
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("pipeclock"):
            continue
        for value in list(vars(module).values()):
            inside = vars(value).values() if isinstance(value, type) else ()
            for cached in (value, *inside):
                if hasattr(cached, "cache_clear"):
                    cached.cache_clear()
    from pipeclock.plan import pipeline_time

    pipeline_time._FLOOR_TERMS.clear()
    pipeline_time._SHAPES.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for schedule, p, m, chunks in SIMULATIONS:
        wall, cpu = timed(lambda s=schedule, p=p, m=m, c=chunks: simulate_once(s, p, m, c), args.repeats)
        rows.append({"what": f"simulate {schedule} p={p} m={m} v={chunks}", "wall_s": wall, "cpu_s": cpu})
    for what, *case in SEARCHES:
        outcome: dict = {}
        wall, cpu = timed(lambda case=case, outcome=outcome: outcome.update(search_once(*case)), args.repeats)
        rows.append({"what": what, "wall_s": wall, "cpu_s": cpu, **outcome})
    load = os.getloadavg()[0]
    lines = [
        "| what | wall (s) | CPU (s) | considered | judged | simulated | best |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        counts = (f"{row['considered']:,} | {row['judged']:,} | {row['simulated']:,} | {row['best']}"
                  if "best" in row else "| | |")  # fmt: skip
        lines.append(f"| {row['what']} | {row['wall_s']:.3f} | {row['cpu_s']:.3f} | {counts} |")
    lines.append("")
    lines.append(f"1-minute load average {load:.1f} on {os.cpu_count()} cores; each figure the least of "
                 f"{args.repeats} runs, every search from empty caches")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster_speed.md").write_text("# The cluster planner's speed\n\n" + text + "\n")
    (RESULTS / "cluster_speed.json").write_text(json.dumps({"load": load, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
