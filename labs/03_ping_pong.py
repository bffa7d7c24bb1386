"""Lab 3: two processes, one tensor, back and forth.

``torchrun`` starts separate Python interpreters: separate memory, separate GIL, scheduled by the OS on
different cores. ``comms.init`` dials each one in to the "conference call" (the process group); after
that, ``send_tensor`` really does push bytes through a local socket (gloo) to the other process.

Run it:  torchrun --nproc-per-node 2 labs/03_ping_pong.py        (or: python -m pipeclock lab 3)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.observe.machine import timing_context

PROCESSES = 2  # how many processes `python -m pipeclock lab 3` asks torchrun for
SIZES = {"4 B": 1, "1 KiB": 256, "64 KiB": 16_384, "1 MiB": 262_144, "8 MiB": 2_097_152}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 3: ping-pong a tensor between two processes")
    parser.add_argument("--repeats", type=int, default=100, help="round trips timed per size")
    return parser.parse_args(argv)


def check_round_trip(rank: int) -> None:
    """Rank 0 sends 0..7; rank 1 checks it, adds one and sends it back; rank 0 checks the answer."""
    ping = torch.arange(8, dtype=torch.float32)
    if rank == 0:
        comms.send_tensor(ping, dest=1)
        pong = comms.recv_tensor(ping.shape, src=1)
        print(
            f"rank 0: sent {ping.int().tolist()}, got back {pong.int().tolist()}: "
            f"{'intact' if torch.equal(pong, ping + 1) else 'CORRUPTED'}",
            flush=True,
        )
    else:
        got = comms.recv_tensor(ping.shape, src=0)
        print(
            f"rank 1: received {got.int().tolist()}: {'intact' if torch.equal(got, ping) else 'CORRUPTED'}",
            flush=True,
        )
        comms.send_tensor(got + 1, dest=0)


def round_trip_seconds(rank: int, numel: int, repeats: int) -> float:
    """Median time for a tensor of ``numel`` floats to go to rank 1 and come back (measured on rank 0)."""
    tensor = torch.rand(numel)
    times = []
    warm_up = 5  # the first round trips pay for buffers and caches; they are not timed
    for _ in range(warm_up + repeats):
        start = time.perf_counter()
        if rank == 0:
            comms.isend(tensor, 1).wait()
            echoed = comms.irecv(tensor.shape, 1).wait()
        else:
            echoed = comms.irecv(tensor.shape, 0).wait()
            comms.isend(echoed, 0).wait()
        times.append(time.perf_counter() - start)
    if rank == 0 and not torch.equal(echoed, tensor):
        raise RuntimeError(f"rank 0: the {numel}-float tensor came back changed")
    return statistics.median(times[warm_up:])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    print(
        f"rank {rank} of world size {world}: PID {os.getpid()}, {torch.get_num_threads()} thread(s)",
        flush=True,
    )
    comms.barrier()
    if world != 2:
        raise SystemExit(f"rank {rank}: lab 3 needs exactly 2 processes, got {world}")
    check_round_trip(rank)
    comms.barrier()
    if rank == 0:
        print("\nsize     round trip   bandwidth (2 x size / round trip)")
    for label, numel in SIZES.items():
        seconds = round_trip_seconds(rank, numel, args.repeats)
        if rank == 0:
            rate = 2 * numel * 4 / seconds / 2**20
            print(f"{label:>7}  {seconds * 1e6:9.1f} us  {rate:9.1f} MiB/s", flush=True)
    comms.barrier()
    if rank == 0:
        print(timing_context())
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
