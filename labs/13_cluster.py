"""Lab 13: planning a cluster run on paper, and checking the plan against a run others published.

Before a cluster is rented, the questions are the ones every lab so far measured on a CPU: does the
model fit, cut which way, and how fast will it go? ``pipeclock plan --cluster NxKIND`` answers them on
paper, from a GPU kind's datasheet and the model's shapes alone: it searches dp x tp x pp, the
schedule, the micro-batch size, recompute and the optimizer-state sharding, drops what does not fit,
and ranks the rest by predicted tokens (or samples) per second per GPU, the pipeline's bubble taken
from the very program simulator the engine's schedules run on.

The lab asks it two questions, and prints what it answers:

1. Lab 2's memory wall in numbers: the 10B-parameter model on four RTX 4090s (the course's card). What
   fits, with which split, at what speed?
2. A run whose numbers were published: torchtitan's Llama 3.1 405B on 512 H100s, FSDP 8 x TP 8 x PP 8,
   with 1F1B and with interleaved 1F1B. The plan of that very configuration is set beside what the run
   measured, with the error.

No process is started and nothing is allocated: a 405B model is planned from its config.json.

Run it:  python labs/13_cluster.py        (or: python -m pipeclock lab 13)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from pipeclock.cli.dispatch import main as pipeclock
from pipeclock.cli.interrupts import run_as_script

GIB = 2**30
CLUSTER = Path("docs") / "cluster"  # the planner's model configs and GPU datasheets, from the repository root

# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 405B on 512 H100s (96 GB of HBM2e,
# 500 W), FSDP 8 x TP 8 x PP 8, Float8, torch.compile, AsyncTP, 256 sequences of 8,192 tokens a step,
# 4 per micro-batch (as many micro-batches as stages), full activation checkpointing.
TORCHTITAN_405B = [  # (schedule and its --fix, tokens/s per GPU, peak GiB reserved)
    ("1f1b", "schedule=1f1b", 100, 82.5),
    ("interleaved-1f1b", "schedule=interleaved-1f1b,chunks=2", 128, 72.7),
]
TORCHTITAN_FLAGS = [
    "--cluster", "512xH100-96GB-500W", "--gpu-spec", str(CLUSTER / "h100-96gb-500w.json"),
    "--hf-config", str(CLUSTER / "llama-3.1-405b.json"), "--global-batch", "256", "--seq-len", "8192",
    "--dtype", "fp8", "--fused", "--tp-overlap",
]  # fmt: skip
TORCHTITAN_FIX = "dp=8,tp=8,pp=8,zero=3,microbatch-size=4,recompute=full,sp=on"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 13: planning a cluster run, beside a published one")
    parser.add_argument("--params", default="10e9", help="part 1: the model's parameters (lab 2's: 10e9)")
    parser.add_argument("--gpus", type=int, default=4, help="part 1: how many RTX 4090s")
    return parser.parse_args(argv)


def plan(argv: list[str], shown: bool = True) -> str:
    """``python -m pipeclock plan ARGV``, run in this process: what it printed (printed too if ``shown``)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pipeclock(["plan", *argv])
    if shown:
        print(f"$ python -m pipeclock plan {shlex.join(argv)}")
        print(printed.getvalue())
    return printed.getvalue()


@dataclass
class Predicted:
    """The planner's figures for one configuration (``plan --fix ... --json``)."""

    tokens: float  # per second per GPU
    memory: float  # GiB per GPU
    bubble: float
    configuration: dict

    @classmethod
    def of(cls, argv: list[str]) -> Predicted:
        found = json.loads(plan([*argv, "--json"], shown=False))
        tokens, memory = found["tokens_per_second_per_gpu"], found["memory_per_gpu_bytes"] / GIB
        return cls(tokens, memory, found["bubble"], found)

    def label(self) -> str:
        c = self.configuration
        layout = f"tp {c['tp']} x pp {c['pp']} x dp {c['dp']}"
        batches = f"mbs {c['microbatch_size']} x m {c['microbatches']}"
        return f"{layout}, {batches}, recompute {c['recompute']}, ZeRO-{c['zero']}"


def gib(value: float) -> str:
    return f"{value:.1f} GiB"


def memory_wall(args: argparse.Namespace) -> None:
    print(f"1. lab 2's memory wall: {args.params} parameters on {args.gpus} RTX 4090s\n")
    plan(["--cluster", f"{args.gpus}xRTX4090", "--params", args.params])


def torchtitan_405b() -> None:
    print("2. a published run: torchtitan's Llama 3.1 405B on 512 H100s, FSDP 8 x TP 8 x PP 8\n")
    first, fix, *_ = TORCHTITAN_405B[0]
    plan([*TORCHTITAN_FLAGS, "--fix", f"{TORCHTITAN_FIX},{fix}"])
    rows = [(name, Predicted.of([*TORCHTITAN_FLAGS, "--fix", f"{TORCHTITAN_FIX},{fix}"]), tokens, memory)
            for name, fix, tokens, memory in TORCHTITAN_405B]  # fmt: skip
    print("published by torchtitan beside predicted, for the same configuration:")
    print("  schedule          tokens/s per GPU               memory per GPU")
    print("                    published  predicted  error    published  predicted  error")
    for name, predicted, tokens, memory in rows:
        print(
            f"  {name:<16}  {tokens:<9}  {predicted.tokens:<9.1f}  {predicted.tokens / tokens - 1:<+7.1%}  "
            f"{gib(memory):<9}  {gib(predicted.memory):<9}  {predicted.memory / memory - 1:+.1%}"
        )
    (_, one, one_published, _), (_, two, two_published, _) = rows
    print(
        f"interleaving's gain: published {two_published / one_published - 1:+.1%}, predicted "
        f"{two.tokens / one.tokens - 1:+.1%} (the simulated bubble {one.bubble:.1%} -> {two.bubble:.1%})"
    )
    free = Predicted.of([*TORCHTITAN_FLAGS, "--fix", f"dp=8,tp=8,pp=8,schedule={first}"])
    print(
        f"the same layout, the rest left to the search ({first}): {free.tokens:.1f} tokens/s per GPU, "
        f"{free.memory:.1f} GiB, bubble {free.bubble:.1%}, as {free.label()} (no run has checked it)"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("Lab 13: planning a cluster run, on paper\n")
    memory_wall(args)
    torchtitan_405b()


if __name__ == "__main__":
    run_as_script(main)
