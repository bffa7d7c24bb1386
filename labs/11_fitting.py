"""Lab 11: fitting the model: activation recompute, bf16, balanced stages, and the planner.

A model that does not fit has four levers besides more devices, and each one trades something:

- activation recompute keeps a block's input instead of everything inside it, and runs the block's
  forward again in the backward: memory for time, with the same math;
- bf16 computes under autocast and sends half the bytes between stages: bytes (and, on hardware that
  multiplies bf16 natively, time) for a little accuracy;
- balanced stages cut the model where the measured costs say, not by layer count: by time, so no rank
  waits for a slower one; by memory, so the rank that holds the most micro-batches holds fewer layers;
- the planner predicts each rank's memory and the step time before anything runs; the lab puts its
  prediction beside every run.

Each lever is one option of the main job (``--recompute``, ``--dtype``, ``--balance``, and ``pipeclock
plan``). The lab trains the small GPT of lab 9 for a few steps with each, on one fixed schedule, and
prints what the engine measured: the activation meter's peak per rank, the bytes each rank sent, the
step time and the loss.

Run it:  torchrun --nproc-per-node 2 labs/11_fitting.py        (or: python -m pipeclock lab 11)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.models.gpt import GPTConfig
from pipeclock.observe.machine import timing_context
from pipeclock.plan.model_specs import gpt_spec
from pipeclock.plan.planner import judge
from pipeclock.plan.profile import profile
from pipeclock.plan.rank_memory import Recompute, Training
from pipeclock.training.loop import TrainConfig, train

PROCESSES = 2  # how many processes `python -m pipeclock lab 11` asks torchrun for
SCHEDULE = "1f1b"
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 11: recompute, bf16, balanced stages, the planner")
    parser.add_argument("--dim", type=int, default=64, help="width of the GPT's hidden states")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--microbatches", "-m", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    parser.add_argument("--every", type=int, default=2, help="K of the every-K recompute run")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@dataclass
class Run:
    """What one run measured, on rank 0."""

    config: TrainConfig
    losses: list[float]
    step_seconds: float
    peaks: list[int]  # the activation meter's peak, per rank
    sent: list[int]  # bytes sent to the neighbours in the last step, per rank
    pieces: list[list[str]]  # the GPT's pieces each rank held
    parameters: list[int]  # per rank

    @property
    def cut(self) -> list[range]:
        bounds = [0, *itertools.accumulate(len(held) for held in self.pieces)]
        return [range(start, stop) for start, stop in itertools.pairwise(bounds)]


def run(args: argparse.Namespace, **changes) -> Run | None:
    """Train the GPT for ``args.steps`` steps with ``changes`` (recompute, dtype or balance).

    Every rank takes part; rank 0 gets the measurements, the others None."""
    config = TrainConfig.from_args(
        args, model="gpt", schedule=SCHEDULE, eval_every=0, eval_batches=1, **changes
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the main job's own notes (the cut it chose)
        result = train(config)
    held = [name for module in result.modules for name, _ in module.named_children()]
    count = sum(p.numel() for module in result.modules for p in module.parameters())
    gathered = comms.gather_object((held, count), "gathering the pieces each rank holds")
    report = result.report
    if report is None:
        return None
    pieces, parameters = zip(*gathered, strict=True)
    ranks = range(len(report.ranks))
    peaks = [report.peak_activation_bytes(rank) for rank in ranks]
    sent = [report.ranks[rank].steps[-1].sent_bytes for rank in ranks]
    return Run(config, result.losses, report.step_seconds, peaks, sent, list(pieces), list(parameters))


def mib(count: float) -> str:
    return f"{count / MIB:.2f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:6.1f} ms"


def per_rank(values: list[int], unit: str = " MiB") -> str:
    return " / ".join(mib(value) for value in values) + unit


# --- 1. recompute -----------------------------------------------------------------------------------


def show_recompute(runs: dict[str, Run]) -> None:
    steps = len(runs["none"].losses)
    print(f"1. recompute: memory against time ({SCHEDULE}, {steps} steps each)")
    print(f"  recompute  peak activations per rank      step       loss after step {steps}")
    for name, found in runs.items():
        print(f"  {name:<9}  {per_rank(found.peaks):<28}  {ms(found.step_seconds)}  {found.losses[-1]:.7f}")
    plain = runs["none"]
    for name, found in list(runs.items())[1:]:
        gap = max(abs(a - b) for a, b in zip(found.losses, plain.losses, strict=True))
        held, slower = found.peaks[0] / plain.peaks[0], found.step_seconds / plain.step_seconds
        print(
            f"  {name}: the losses of all {steps} steps differ from none's by at most {gap:g}; rank 0 holds "
            f"{held:.2f}x the activations, for {slower:.2f}x the step time"
        )
    print()


# --- 2. bf16 -----------------------------------------------------------------------------------------


def bf16_flags() -> list[str]:
    """The CPU's bf16 instructions, as Linux lists them (empty where it lists none, or elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return sorted(flags & {"avx512_bf16", "amx_bf16"})


def show_bf16(fp32: Run, bf16: Run) -> None:
    steps = len(fp32.losses)
    print("2. bf16 against fp32")
    print(f"  dtype  bytes sent per step, per rank    step       loss after step {steps}")
    for name, found in (("fp32", fp32), ("bf16", bf16)):
        sent = " / ".join(f"{value:,} B" for value in found.sent)
        print(f"  {name:<5}  {sent:<29}  {ms(found.step_seconds)}  {found.losses[-1]:.7f}")
    pairs = enumerate(zip(fp32.sent, bf16.sent, strict=True))
    shares = ", ".join(f"rank {rank} {half / whole:.3f}x" for rank, (whole, half) in pairs)
    gap = (bf16.losses[-1] - fp32.losses[-1]) / fp32.losses[-1]
    print(f"  bf16 sends {shares} fp32's bytes; its loss after step {steps} is {gap:+.3%} from fp32's")
    positions = fp32.config.batch_size * fp32.config.seq_len * 8
    floats = [value - positions for value in (fp32.sent[0], bf16.sent[0])]
    print(
        f"  rank 0 also sends the token positions, int64 in both: {fp32.config.batch_size} x "
        f"{fp32.config.seq_len} x 8 B = {positions:,} B; the rest is {floats[0]:,} B -> {floats[1]:,} B "
        f"({floats[1] / floats[0]:.3f}x)"
    )
    flags = bf16_flags()
    native = f"has {', '.join(flags)}: it multiplies bf16 natively" if flags else "lists no bf16 instructions"
    ratio = bf16.step_seconds / fp32.step_seconds
    print(f"  this CPU {native}; bf16's step took {ratio:.2f}x fp32's here\n")


# --- 3. balanced stages --------------------------------------------------------------------------------


def show_balance(runs: dict[str, Run], profiles: dict[str, list]) -> None:
    print(f"3. balanced stages: where each balance cuts the GPT ({SCHEDULE}), in MiB per rank")
    print("  balance  rank 0 | rank 1            weights, grads, Adam  peak activations  together")
    for name, found in runs.items():
        cut = " | ".join(" ".join(held) for held in found.pieces)
        state = [16 * count for count in found.parameters]  # fp32 weight and gradient, Adam's two moments
        together = [a + b for a, b in zip(state, found.peaks, strict=True)]
        shown = [per_rank(values, "") for values in (state, found.peaks, together)]
        print(f"  {name:<7}  {cut:<24}  {shown[0]:<20}  {shown[1]:<16}  {shown[2]}")
    print("  balance  step predicted by the simulator  measured")
    for name, found in runs.items():
        print(f"  {name:<7}  {ms(predict(profiles, found).step_time):<31}  {ms(found.step_seconds)}")
    print()


# --- 4. the planner beside the runs --------------------------------------------------------------------


def predict(profiles: dict[str, list], found: Run):
    """The planner's plan for the configuration ``found`` ran: its schedule, dtype, recompute and cut,
    from the pieces' costs profiled in its dtype."""
    config = found.config
    layers = profiles[config.dtype]
    training = Training(config.dtype, "adam", Recompute.parse(config.recompute))
    stages = len(found.pieces)
    return judge(layers, SCHEDULE, stages, config.microbatches, training, cut=found.cut)


def show_planner(runs: dict[str, Run], profiles: dict[str, list], samples: int) -> None:
    print(f"4. the planner beside the runs (each piece profiled here, micro-batches of {samples} sequences)")
    plans = {name: predict(profiles, found) for name, found in runs.items()}
    print("  run                activations predicted / measured, per rank")
    for name, found in runs.items():
        cells = [
            f"{mib(planned.activations)} / {mib(measured)} MiB ({measured / planned.activations:.2f}x)"
            for planned, measured in zip(plans[name].memory, found.peaks, strict=True)
        ]
        print(f"  {name:<17}  {'   '.join(cells)}")
    print("  run                step predicted / measured")
    for name, found in runs.items():
        predicted = plans[name].step_time
        ratio = found.step_seconds / predicted
        print(f"  {name:<17}  {predicted * 1e3:.1f} / {ms(found.step_seconds).strip()} ({ratio:.2f}x)")


def profiled_layers(args: argparse.Namespace) -> tuple[dict[str, list], int]:
    """Every piece's measured costs for one micro-batch, in float32 and in bf16: what ``pipeclock plan
    --model gpt --dtype ...`` measures."""
    gpt = GPTConfig(dim=args.dim, layers=args.layers, heads=args.heads, seq_len=args.seq_len, seed=args.seed)
    samples = math.ceil(args.batch_size / args.microbatches)
    return {dtype: profile(gpt_spec(gpt), samples, dtype=dtype) for dtype in ("fp32", "bf16")}, samples


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    if world < 2:
        raise SystemExit("lab 11 compares what stages hold and send: it needs 2 processes or more")
    if rank == 0:
        print(
            f"Lab 11: a GPT of {args.layers} blocks x {args.dim} ({args.heads} heads, {args.seq_len}-byte "
            f"sequences), batch {args.batch_size}, m = {args.microbatches}, on {world} stages\n",
            flush=True,
        )
    every = f"every-{args.every}"
    recompute = {name: run(args, recompute=name) for name in ("none", every, "full")}
    bf16 = run(args, dtype="bf16")
    balanced = {name: run(args, balance=name) for name in ("time", "memory")}
    if rank == 0:
        profiles, samples = profiled_layers(args)
        show_recompute(recompute)
        show_bf16(recompute["none"], bf16)
        show_balance({"layers": recompute["none"], **balanced}, profiles)
        everything = {**{f"recompute {k}": v for k, v in recompute.items()}, "bf16": bf16}
        everything |= {f"balance {k}": v for k, v in balanced.items()}
        show_planner(everything, profiles, samples)
    if rank == 0:
        print(timing_context())
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
