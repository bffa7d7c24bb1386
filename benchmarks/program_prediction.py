"""The simulator against the run: each case's measured median step beside its program's simulated step.

    python -m benchmarks.program_prediction            # measure the link and the cases, then compare
    python -m benchmarks.program_prediction --from-json benchmarks/results/program.json

The program (``pipeclock.engine.program``) is the one the engine ran: the schedule lowered with its
messages. The simulator runs it with each op's mean compute time as that case measured it (``compute_ms``)
and each message's cost from the link measured in the same run on this machine (two ranks, gloo:
``link_latency_s`` and ``link_bandwidth``, from a ping-pong of 4 bytes and of 1 MiB), and prints the
predicted step beside the measured median step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import run as bench_run
from benchmarks.launch import ROOT, torchrun
from pipeclock import comms
from pipeclock.engine.actions import join_first_stage_backwards
from pipeclock.engine.generators import generate
from pipeclock.engine.program import Instruction, lower
from pipeclock.engine.program_run import simulate_program

FLOAT_BYTES = 4
RESULTS = ROOT / "benchmarks" / "results"
SMALL, LARGE = 1, 262_144  # floats: 4 B and 1 MiB


def one_way_seconds(numel: int, repeats: int = 50) -> float:
    """Half the median round trip of ``numel`` floats between ranks 0 and 1 (rank 0's clock)."""
    rank, tensor, times = comms.get_rank(), torch.rand(numel), []
    for _ in range(5 + repeats):
        start = time.perf_counter()
        if rank == 0:
            comms.isend(tensor, 1).wait()
            comms.irecv(tensor.shape, 1).wait()
        else:
            comms.isend(comms.irecv(tensor.shape, 0).wait(), 0).wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) / 2


def measure_link(out: Path) -> None:
    """Under torchrun, two ranks: the link's latency (4 B one way) and bandwidth (1 MiB past it)."""
    comms.init()
    small, large = one_way_seconds(SMALL), one_way_seconds(LARGE)
    if comms.get_rank() == 0:
        bandwidth = (LARGE - SMALL) * FLOAT_BYTES / max(large - small, 1e-9)
        out.write_text(json.dumps({"link_latency_s": small, "link_bandwidth": bandwidth}))
    comms.shutdown()


def predicted_seconds(case: dict, link: dict) -> float:
    """The simulated step of ``case`` (a results record) with its measured op times and ``link``."""
    table = join_first_stage_backwards(
        generate(case["schedule"], case["stages"], case["microbatches"], case["chunks"])
    )
    costs = {op: ms / 1e3 for op, ms in case["engines"]["pipeclock"]["compute_ms"].items()}
    costs.setdefault("B", costs.get("I", 0.0) + costs.get("W", 0.0))
    message = case["batch"] / case["microbatches"] * case["hidden"] * FLOAT_BYTES

    def compute(_rank: int, instruction: Instruction) -> float:
        return costs[instruction.kind]

    timeline = simulate_program(
        lower(table, ties=True),
        compute,
        latency=link["link_latency_s"],
        bandwidth=link["link_bandwidth"],
        message_bytes=lambda _: message,
        step_seconds=link["link_latency_s"],
    )
    return timeline.makespan


def rows(results: dict) -> list[str]:
    link = results["link"]
    lines = [
        f"link: latency {link['link_latency_s'] * 1e6:.0f} us, "
        f"bandwidth {link['link_bandwidth'] / 2**30:.2f} GiB/s (ping-pong, two ranks)",
        "",
        "| p | m | schedule | measured median step (ms) | simulated program (ms) | error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in (record for record in results["runs"][0] if record["kind"] == "case"):
        measured = case["engines"]["pipeclock"]["median_s"]
        predicted = predicted_seconds(case, link)
        error = predicted / measured - 1
        lines.append(
            f"| {case['stages']} | {case['microbatches']} | {case['schedule']} | {measured * 1e3:.1f} "
            f"| {predicted * 1e3:.1f} | {error:+.1%} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.program_prediction")
    parser.add_argument("--from-json", type=Path, help="compare a saved run; measure nothing")
    parser.add_argument("--link-out", type=Path, help=argparse.SUPPRESS)  # the link worker, under torchrun
    args = parser.parse_args(argv)
    if args.link_out:
        return measure_link(args.link_out)
    path = args.from_json
    if path is None:
        link = RESULTS / "program-link.json"
        torchrun("benchmarks.program_prediction", 2, ["--link-out", str(link)], 600)
        bench_run.main(["--program", "--no-overhead", "--no-figures", "--name", "program"])
        path = RESULTS / "program.json"
        results = json.loads(path.read_text())
        results["link"] = json.loads(link.read_text())
        path.write_text(json.dumps(results, indent=1) + "\n")
        link.unlink()
    table = "\n".join(rows(json.loads(path.read_text())))
    (RESULTS / "program-prediction.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
