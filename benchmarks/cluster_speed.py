"""How fast the cluster planner answers: the program simulator on a long interleaved step, and a 405B search
on 16,384 GPUs.

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
LLAMA_405B = Path(__file__).resolve().parent.parent / "docs" / "cluster" / "llama-3.1-405b.json"
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


def search_405b() -> dict:
    from pipeclock.plan import cluster_memory, cluster_time
    from pipeclock.plan.cluster_config import Job, Software
    from pipeclock.plan.gpus import KINDS, Cluster
    from pipeclock.plan.hf_paper import paper_model, read_config
    from pipeclock.plan.search import search

    for cached in (cluster_time.simulated, cluster_memory.held_microbatches, cluster_memory.placement_for):
        cached.cache_clear()
    model = paper_model(read_config(LLAMA_405B))
    found = search(model, Cluster(16384, KINDS["H100-80GB"]), Job(1024, 8192), Software("bf16"))
    best = found.ranked[0]
    return {
        "considered": found.considered, "judged": found.judged, "fitting": found.fitting,
        "simulated": found.simulated,
        "best": best.config.label(), "tokens_per_second_per_gpu": round(best.tokens_per_second_per_gpu, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for schedule, p, m, chunks in SIMULATIONS:
        wall, cpu = timed(lambda s=schedule, p=p, m=m, c=chunks: simulate_once(s, p, m, c), args.repeats)
        rows.append({"what": f"simulate {schedule} p={p} m={m} v={chunks}", "wall_s": wall, "cpu_s": cpu})
    outcome = {}

    def run_search() -> None:
        outcome.update(search_405b())

    wall, cpu = timed(run_search, args.repeats)
    rows.append({"what": "search: Llama 3.1 405B, 16384 x H100-80GB, 1024 x 8192 tokens", "wall_s": wall,
                 "cpu_s": cpu, **outcome})  # fmt: skip
    load = os.getloadavg()[0]
    lines = ["| what | wall (s) | CPU (s) |", "|---|---:|---:|"]
    lines += [f"| {row['what']} | {row['wall_s']:.3f} | {row['cpu_s']:.3f} |" for row in rows]
    lines.append("")
    lines.append(
        f"1-minute load average {load:.1f} on {os.cpu_count()} cores; the search considered "
        f"{outcome['considered']:,} configurations, judged {outcome['judged']:,} best-first, "
        f"{outcome['fitting']:,} of them fit and were simulated; "
        f"best: {outcome['best']} ({outcome['tokens_per_second_per_gpu']} tokens/s per GPU)"
    )
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster_speed.md").write_text("# The cluster planner's speed\n\n" + text + "\n")
    (RESULTS / "cluster_speed.json").write_text(json.dumps({"load": load, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
