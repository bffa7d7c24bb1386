"""What every rank runs under torchrun: each (hidden, m) group of cases, every participant in turn.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.worker --plan plan.json --out out.jsonl

``benchmarks.run`` writes the plan and launches this; rank 0 appends one JSON line per baseline and per
case to ``--out`` as soon as it is measured, so a sweep cut short still leaves its results.

The machine is shared and its speed drifts, so nothing is timed in a block of its own. The cases of one
(hidden, m) are built side by side and their steps are taken round-robin: one-process step, pipeclock
GPipe, torch GPipe, pipeclock 1F1B, torch 1F1B, ... then the next round. Drift then falls on every
engine and schedule alike, and so on the ratios and efficiencies computed from them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import sys

import torch

from benchmarks.baseline import OneProcess
from benchmarks.case import CaseRun
from benchmarks.plan import Case, Plan, from_json
from pipeclock import comms


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one rank of a benchmark sweep (launch with torchrun)")
    parser.add_argument("--plan", required=True, help="the plan, as written by benchmarks.run")
    parser.add_argument("--out", required=True, help="JSON lines file that rank 0 appends results to")
    parser.add_argument("--baseline", action="store_true", help="also measure the one-process T1")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any blocking call may take")
    return parser.parse_args(argv)


class Emitter:
    """Rank 0's output: one JSON object per line, flushed at once; a short progress line on stdout."""

    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, record: dict | None) -> None:
        if self.path is None or record is None:
            return
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")
        print(progress(record), flush=True)


def progress(record: dict) -> str:
    """One line per record, for the person watching the sweep."""
    if record["kind"] == "baseline":
        return f"  T1 hidden={record['hidden']} m={record['microbatches']}: {record['t1_s'] * 1e3:.1f} ms"
    if record["kind"] != "case":
        return f"  {json.dumps(record)}"
    head = f"  p={record['stages']} hidden={record['hidden']} m={record['microbatches']} {record['schedule']}"
    times = {name: figures["median_s"] for name, figures in record["engines"].items()}
    text = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in times.items())
    if "torch" in times:
        text += f" (ratio {times['pipeclock'] / times['torch']:.3f})"
    return f"{head}: {text}"


def check_threads(world: int) -> dict:
    """Every rank's intra-op threads: one per process when the ranks fill the cores (the fair setting)."""
    mine = torch.tensor([torch.get_num_threads()], dtype=torch.int64)
    threads = [int(t) for t in comms.all_gather(mine, "gathering thread counts")]
    if comms.threads_per_process() == 1 and any(t != 1 for t in threads):
        raise RuntimeError(f"expected one intra-op thread per rank on {world} ranks, got {threads}")
    return {"kind": "setup", "world": world, "threads": threads, "torch": torch.__version__}


def run_group(cases: list[Case], one_process: OneProcess | None, rounds: int, emit: Emitter) -> None:
    """Check every case, then take ``rounds`` timed steps round-robin over all participants."""
    runs = [CaseRun(case) for case in cases]
    if one_process:
        one_process.step(0)  # its warm-up; the engines warm up on their checked step
    for run in runs:
        run.run_check()
    for index in range(1, rounds + 1):
        if one_process:
            one_process.step(index)
        for run in runs:
            run.timed_step(index)
    if one_process:
        emit(one_process.result())
    for run in runs:
        emit(run.result())


def release_memory() -> None:
    """Free the finished group's tensors and hand the freed heap back to the OS before the next group.

    The engines hold reference cycles (their patched methods), which only the collector frees; and
    glibc keeps freed memory in its heap, so without a trim each group would start from the last
    group's high-water mark and a sweep of large models would grow until the kernel kills a rank.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def run(plan: Plan, with_baseline: bool, emit: Emitter) -> None:
    """Every (hidden, m) of the plan: this world size's cases, and T1 when asked."""
    cases = plan.for_stages(comms.get_world_size())
    for hidden, m in plan.baselines():
        group = [case for case in cases if (case.hidden, case.microbatches) == (hidden, m)]
        like = next(case for case in plan.cases if (case.hidden, case.microbatches) == (hidden, m))
        one_process = OneProcess(hidden, m, like.layers, like.batch) if with_baseline else None
        rounds = max((case.steps for case in group), default=plan.baseline_steps[hidden])
        if group or one_process:
            run_group(group, one_process, rounds, emit)
            release_memory()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = comms.init(timeout=args.timeout)
    emit = Emitter(args.out if rank == 0 else None)
    with open(args.plan) as source:
        plan = from_json(json.load(source))
    emit(check_threads(world))
    run(plan, args.baseline, emit)
    comms.barrier("finishing the sweep")
    comms.shutdown()  # only on success: after a failure torchrun tears the ranks down
    return 0


if __name__ == "__main__":
    sys.exit(main())
