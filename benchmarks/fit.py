"""What recompute and bf16 cost and save: step time, activation peak and message bytes, on 2 ranks.

    python -m benchmarks.fit                         # starts torchrun itself (2 ranks), prints a table
    python -m benchmarks.fit --steps 10 --rounds 5   # longer runs, more rounds (default 6 steps, 3 rounds)

Every configuration trains the main job's default model (the MLP, 16 x 1024, batch 128, or batch 1024
where the table says so; or the GPT, 4 blocks x 128, batch 16, sequences of 128) with 8 micro-batches,
in one torchrun launch. The configurations take turns, round after round, so that a disturbance of a
shared machine hits them alike. A step's time is the median over a run's steps of the slowest rank's
step, and the table gives the fastest round's. The activation peak is the activation meter's, per rank;
the bytes are the floating-point payload each rank hands to ``comms.isend`` in one step (activations
forward, gradients back).
"""

from __future__ import annotations

import argparse
import os

CONFIGS = [
    # (model, schedule, recompute, dtype[, batch size])
    ("mlp", "1f1b", "none", "fp32"),
    ("mlp", "1f1b", "none", "bf16"),
    ("mlp", "1f1b", "none", "fp32", 1024),
    ("mlp", "1f1b", "none", "bf16", 1024),
    ("mlp", "1f1b", "full", "fp32"),
    ("mlp", "zb-h1", "none", "fp32"),
    ("mlp", "zb-h1", "full", "fp32"),
    ("gpt", "1f1b", "none", "fp32"),
    ("gpt", "1f1b", "none", "bf16"),
    ("gpt", "1f1b", "full", "fp32"),
    ("gpt", "1f1b", "every-1", "fp32"),
    ("gpt", "1f1b", "every-2", "fp32"),
    ("gpt", "zb-h1", "none", "fp32"),
    ("gpt", "zb-h1", "full", "fp32"),
    ("gpt", "zb-h1", "every-1", "fp32"),
]
MIB = 2**20


def worker(steps: int, rounds: int) -> None:
    from pipeclock import comms
    from pipeclock.training.loop import TrainConfig, train

    sent = {"bytes": 0}
    isend = comms.isend

    def counting_isend(tensor, *args, **kwargs):
        if tensor.is_floating_point():
            sent["bytes"] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)

    comms.isend = counting_isend
    rows = {}
    for _ in range(rounds):
        for model, schedule, recompute, dtype, *batch in CONFIGS:
            sent["bytes"] = 0
            config = TrainConfig(
                model=model, schedule=schedule, recompute=recompute, dtype=dtype, steps=steps,
                eval_every=0, eval_batches=1, batch_size=batch[0] if batch else None,
            )  # fmt: skip
            result = train(config)
            everyone = comms.all_gather_object(sent["bytes"] // steps, "gathering the bytes sent")
            if result.report is not None:
                report = result.report
                peaks = [report.peak_activation_bytes(rank) / MIB for rank in range(len(report.ranks))]
                name = model if not batch else f"{model}, batch {batch[0]}"
                key = (name, schedule, recompute, dtype)
                fastest = min(report.step_seconds, rows.get(key, (float("inf"),))[0])
                rows[key] = (fastest, peaks, everyone)
    if comms.get_rank() == 0:
        print_table([(*key, *found) for key, found in rows.items()])
    comms.shutdown()


def print_table(rows) -> None:
    print("| model | schedule | recompute | dtype | step (ms) | peak activations, rank 0 / 1 (MiB) "
          "| bytes sent per step, rank 0 / 1 |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|")
    for model, schedule, recompute, dtype, seconds, peaks, sent in rows:
        peak_text = " / ".join(f"{peak:.2f}" for peak in peaks)
        sent_text = " / ".join(f"{value / MIB:.2f} MiB" for value in sent)
        cells = [model, schedule, recompute, dtype, f"{seconds * 1e3:.0f}", peak_text, sent_text]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.steps, args.rounds)
        return
    from benchmarks.launch import torchrun

    torchrun("benchmarks.fit", 2, ["--steps", str(args.steps), "--rounds", str(args.rounds)], args.timeout)


if __name__ == "__main__":
    main()
