"""Lab 1: the single-CPU baseline.

Before splitting anything, train the whole model in one process: an ``nn.Sequential`` of 16 Linear
layers (ReLU between them) on a synthetic regression task. Every later lab is measured against this one:
the same model, the same data, the same numbers, just spread over processes.

Run it:  python labs/01_baseline.py        (or: python -m pipeclock lab 1)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pipeclock.cli.interrupts import run_as_script
from pipeclock.model import full_mlp, parameter_bytes
from pipeclock.models.regression import SyntheticRegression
from pipeclock.observe.machine import timing_context


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 1: train a 16-layer MLP on one CPU")
    parser.add_argument("--hidden", type=int, default=256, help="width of every layer")
    parser.add_argument("--layers", type=int, default=16, help="number of Linear layers")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = full_mlp(args.hidden, args.layers, seed=args.seed)
    data = SyntheticRegression(args.hidden, seed=args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    params = sum(p.numel() for p in model.parameters())
    print(f"model: nn.Sequential of {args.layers} Linear({args.hidden}, {args.hidden}) layers, ReLU between")
    print(f"parameters: {params:,} ({parameter_bytes(model) / 2**20:.1f} MiB of fp32 weights)")
    print(f"training on 1 process, {torch.get_num_threads()} intra-op threads\n")

    losses, step_times = [], []
    for step in range(args.steps):
        inputs, targets = data.batch(step, args.batch_size)
        start = time.perf_counter()
        loss = F.mse_loss(model(inputs), targets)  # forward: activations are kept for backward
        optimizer.zero_grad()
        loss.backward()  # backward: autograd walks the graph back, filling every .grad
        optimizer.step()
        step_times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")

    first, last, recent = losses[0], losses[-1], losses[-5:]  # one batch's loss is noisy: show a mean too
    step_time = statistics.median(step_times)
    print(
        f"\nloss fell from {first:.4f} at step 0 to {last:.4f} at step {args.steps - 1} "
        f"({first / last:.0f}x); the last {len(recent)} steps average {statistics.fmean(recent):.4f}"
    )
    print(f"step time {step_time * 1e3:.2f} ms (median), {args.batch_size / step_time:,.0f} samples/s")
    print(timing_context())


if __name__ == "__main__":
    run_as_script(main)
