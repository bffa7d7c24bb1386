"""pipeclock's step on one device against a plain PyTorch loop over the same micro-batches.

    python -m benchmarks.plain_loop                     # the GPT 768 x 12, sequences of 512, batch 32, m 4
    python -m benchmarks.plain_loop --dim 64 --layers 2 --heads 2 --seq-len 64 --batch 8   # seconds, a CPU

One process, one stage (p = 1), on the GPU when there is one. The plain loop is what a user writes without
an engine: for each micro-batch, the whole model's forward, the loss weighted by its share of the batch's
tokens, backward; the step ends when its loss is a number on the host. pipeclock's step runs the same
model (built from the same seed) with the same micro-batches through ``Pipeline.step``, with its
activation meter (the default) and without. Steps of the three alternate, so a disturbance hits all; the
first steps warm up and are not counted; the figure is each one's median step. What an engine may cost on
top of the loop is the time its own Python and its timing take: on a GPU, a device synchronize per action
would also keep the CPU from queueing the next action's kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pipeclock import comms, schedule
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.models.gpt import GPT, GPTConfig, gpt_sequential

ENGINES = ("plain loop", "pipeclock", "pipeclock, meter off")


def _synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _loop_step(model, loss_fn: TokenCrossEntropy, inputs, targets, m: int) -> float:
    """The plain loop: each micro-batch forward and backward, its loss weighted by its share of the tokens."""
    total, count = None, loss_fn.count(targets)
    for x, y in zip(inputs.chunk(m), targets.chunk(m), strict=True):
        loss = loss_fn(model(x), y) / count
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return float(total)


def measure(config: GPTConfig, batch: int, m: int, steps: int, warmup: int, dtype: str) -> dict[str, float]:
    """Each engine's median step time in seconds, on this process's device (a one-process world)."""
    comms.init()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=generator).to(device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    loss_fn = TokenCrossEntropy()
    plain = gpt_sequential(config).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def engine(meter: bool) -> Callable[[], float]:
        stage = GPT.for_rank(config, 0, 1)[0].to(device)
        pipe = schedule.Pipeline(stage, "1f1b", m, loss_fn, measure_memory=meter, dtype=dtype)
        return lambda: pipe.step(inputs, targets)

    def loop() -> float:
        with autocast:
            return _loop_step(plain, loss_fn, inputs, targets, m)

    runs = {"plain loop": loop, "pipeclock": engine(True), "pipeclock, meter off": engine(False)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(warmup + steps):
        for name, run in runs.items():
            start = _synchronized(device)
            run()
            end = _synchronized(device)
            if step >= warmup:
                times[name].append(end - start)
    comms.shutdown()
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plain_loop", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    config = GPTConfig(dim=args.dim, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    medians = measure(config, args.batch, args.microbatches, args.steps, args.warmup, args.dtype)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU"
    print(
        f"GPT {args.dim} x {args.layers} ({args.heads} heads), seq {args.seq_len}, batch {args.batch}, "
        f"m {args.microbatches}, {args.dtype}, one stage on {where}: median of {args.steps} steps"
    )
    loop = medians["plain loop"]
    for name in ENGINES:
        print(f"  {name:<21} {medians[name] * 1e3:9.1f} ms   {medians[name] / loop:.3f} x the plain loop")


if __name__ == "__main__":
    main()
