"""What an engine costs by itself: CPU per action and time waiting on messages, with compute made ~0.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.overhead --out overhead.jsonl

With 16 Linear layers of width 16 a matrix product takes a microsecond or two, so a step is almost all
engine: Python, autograd bookkeeping, gloo calls. Per schedule, every engine (pipeclock, pipeclock without
its activation meter, torch) takes its steps in turn, and we report per rank:

- CPU time per micro-batch and per action (F, B or W): the process's CPU time over a step (all threads,
  gloo's included) divided by the rank's actions. CPU time, unlike wall time, does not grow while a
  neighbour is late, or while another process holds the core;
- the bare work: the same forwards and backwards on the same chunk in a plain loop, no engine, no
  messages. The engine's own cost per action is the difference;
- the share of the step spent blocked on messages, and the step's wall time.

Then rank 0 runs each engine's steps under cProfile, timed by the main thread's CPU clock: time blocked on
a message, or spent while another process holds the core, counts for nothing, so on a busy machine the
profile still says where the engine's own microseconds go. The functions are summed into parts (the
activation meter, the split backward's hooks and W, the messages, the step loop, torch's engine, the
model's forward, autograd ...) and the functions with the most time of their own are listed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.case import CaseRun
from benchmarks.launch import ROOT
from benchmarks.plan import Case
from pipeclock import comms

HIDDEN, BATCH, MICROBATCHES = 16, 64, 16
SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="per-action engine overhead (launch with torchrun)")
    parser.add_argument("--out", required=True, help="JSON lines file that rank 0 appends results to")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per engine and schedule")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any blocking call may take")
    parser.add_argument(
        "--profile-only", action="store_true", help="only the profile (of the first of --schedules)"
    )
    return parser.parse_args(argv)


def bare_cpu_per_microbatch(case: Case, modules: list[torch.nn.Module], repeats: int = 200) -> float:
    """CPU seconds of one micro-batch's forward and whole backward through this rank's chunk, no engine."""
    size = case.batch // case.microbatches
    first, last = comms.get_rank() == 0, comms.get_rank() == comms.get_world_size() - 1
    x = torch.randn(size, case.hidden, requires_grad=not first)
    target, grad = torch.randn(size, case.hidden), torch.ones(size, case.hidden)
    start = time.process_time()
    for _ in range(repeats):
        for module in modules:
            out = module(x)
            if last:
                F.mse_loss(out, target).backward()
            else:
                out.backward(grad)
    return (time.process_time() - start) / repeats


def actions_per_microbatch(case: Case) -> int:
    return (3 if case.schedule in ("zb-h1", "zb-v") else 2) * case.chunks


def measure(case: Case) -> dict | None:
    """Every engine's step, wall, CPU and wait figures at ~zero compute, and the bare work beside them."""
    run = CaseRun(case, with_unmetered=True)
    run.run_check()
    for index in range(1, case.steps + 1):
        run.timed_step(index)
    bare = bare_cpu_per_microbatch(case, run.engines[0].modules)
    bare_all = [float(t) for t in comms.all_gather(torch.tensor([bare], dtype=torch.float64), "bare times")]
    record = run.result()
    if record is None:
        return None
    per_action = actions_per_microbatch(case)
    for figures in record["engines"].values():
        per_mb = [cpu / case.microbatches for cpu in figures["cpu_s"]]
        figures["cpu_us_per_action"] = [t / per_action * 1e6 for t in per_mb]
        figures["overhead_us_per_action"] = [
            (t - b) / per_action * 1e6 for t, b in zip(per_mb, bare_all, strict=True)
        ]
    record["kind"] = "overhead"
    record["bare_cpu_us_per_action"] = [b / 2 * 1e6 for b in bare_all]  # a bare micro-batch is F and B
    return record


def profile(case: Case, steps: int, top: int = 12) -> list[dict]:
    """Each engine's steps with rank 0 under cProfile: the functions with the most time of their own."""
    run = CaseRun(case)
    run.run_check()
    records = []
    for engine in run.engines:
        profiler = cProfile.Profile(time.thread_time) if comms.get_rank() == 0 else None
        if profiler:
            profiler.enable()
        for index in range(1, steps + 1):
            run.step_engine(engine, run.batch(index), metering=False)
        if profiler:
            profiler.disable()
            records.append(_top_functions(profiler, engine.name, case, steps, top))
    return records


def _top_functions(profiler: cProfile.Profile, engine: str, case: Case, steps: int, top: int) -> dict:
    stats = pstats.Stats(profiler)
    rows = sorted(
        (
            (own, calls, f"{_short(filename)}:{line}({function})")
            for (filename, line, function), (_, calls, own, _, _) in stats.stats.items()
        ),
        reverse=True,
    )
    actions = steps * case.microbatches * actions_per_microbatch(case)
    parts: dict[str, float] = {}
    for own, _, name in rows:
        parts[_part(name)] = parts.get(_part(name), 0.0) + own / actions * 1e6
    return {
        "kind": "profile",
        "engine": engine,
        "schedule": case.schedule,
        "actions": actions,
        "total_us_per_action": sum(r[0] for r in rows) / actions * 1e6,
        "parts_us_per_action": dict(sorted(parts.items(), key=lambda item: -item[1])),
        "functions": [
            {"function": name, "calls_per_action": calls / actions, "own_us_per_action": own / actions * 1e6}
            for own, calls, name in rows[:top]
        ],
    }


PARTS = (  # (what the time is, a marker in the function's name), first match wins
    ("model forward (Linear, ReLU, nn.Module)", "pipeclock/model"),
    ("pipeclock: activation meter", "pipeclock/engine/memory.py"),
    ("pipeclock: split backward (hooks, W)", "pipeclock/engine/backward.py"),
    ("pipeclock: messages (messenger, comms, pytree)", "pipeclock/engine/messenger.py"),
    ("pipeclock: messages (messenger, comms, pytree)", "pipeclock/comm"),  # comms.py and its comm_*.py
    ("pipeclock: messages (messenger, comms, pytree)", "pipeclock/engine/pytree.py"),
    ("pipeclock: step loop (step_run, orchestrator, spans ...)", "pipeclock/"),
    ("engine Python (torch pipelining)", "torch/distributed/pipelining/"),
    ("measurement (benchmarks/)", "benchmarks/"),
    ("gloo calls: send, recv, wait, collectives", "_distributed_c10d."),
    ("autograd engine (backward kernels)", "run_backward"),
    ("model forward (Linear, ReLU, nn.Module)", "torch/nn/"),
    ("model forward (Linear, ReLU, nn.Module)", "_nn.linear"),
    ("model forward (Linear, ReLU, nn.Module)", "torch.relu"),
)


def _part(name: str) -> str:
    return next((part for part, marker in PARTS if marker in name), "other (torch Python, builtins)")


def _short(filename: str) -> str:
    for marker in ("site-packages/", f"{ROOT}/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, _ = comms.init(timeout=args.timeout)
    records = []
    for name in [] if args.profile_only else args.schedules:
        case = Case(comms.get_world_size(), HIDDEN, MICROBATCHES, name, args.steps, batch=BATCH)
        records.append(measure(case))
    profiled = Case(comms.get_world_size(), HIDDEN, MICROBATCHES, args.schedules[0], 1, BATCH)
    profiles = profile(profiled, args.steps)
    if rank == 0:
        with open(args.out, "a") as out:
            for record in records + profiles:
                out.write(json.dumps(record) + "\n")
        for record in records:
            print(summary_line(record), flush=True)
        for record in profiles:
            print(profile_line(record), flush=True)
    comms.barrier("finishing the overhead measurement")
    comms.shutdown()
    return 0


def summary_line(record: dict) -> str:
    parts = [
        f"  overhead {record['schedule']}: bare {statistics.fmean(record['bare_cpu_us_per_action']):.0f} us"
    ]
    for name, figures in record["engines"].items():
        parts.append(f"{name} {statistics.fmean(figures['cpu_us_per_action']):.0f} us")
    return ", ".join(parts) + " CPU per action"


def profile_line(record: dict) -> str:
    top = ", ".join(f"{part} {us:.0f}" for part, us in list(record["parts_us_per_action"].items())[:6])
    return f"  profile {record['engine']} {record['schedule']}: {record['total_us_per_action']:.0f} us: {top}"


if __name__ == "__main__":
    sys.exit(main())
