"""One rank of ``benchmarks.generation``'s grid: ``torchrun --nproc-per-node P -m
benchmarks.generation_worker CKPT PROMPTS TOKENS ROUNDS OUT``. Each round generates the prompts once per
group count (1..4, in turn, so that the machine's other work falls on every count alike); the last rank
writes, per group count, each round's time to the first byte and decode bytes per second."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from pipeclock import comms
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.generation.pipeline import Settings, StageRunner, split_groups
from pipeclock.generation.stage_model import StageModel

GROUPS = (1, 2, 3, 4)


def main(directory: str, prompts_path: str, tokens: int, rounds: int, out: str) -> None:
    rank, world = comms.init(timeout=300)
    torch.set_num_threads(1)  # as the generate command runs
    path = checkpoint_choice.resolve(directory)
    model = StageModel.of(checkpoint_choice.read_run(path), path, world)
    pieces = model.build(rank, world)
    checkpoint.load_weights(path, [pieces])
    prompts = [list(line) for line in Path(prompts_path).read_bytes().splitlines() if line]
    settings = Settings(tokens, model.seq_len, model.dim)
    found: dict[int, list[dict]] = {groups: [] for groups in GROUPS}
    for _ in range(rounds):
        for groups in GROUPS:
            comms.barrier("starting a case")
            cut = split_groups(len(prompts), groups)
            runner = StageRunner(pieces, prompts, cut, settings, model.decoding)
            outcome = runner.run()
            first = min(outcome.first_byte_s.values(), default=0.0)
            decoded = len(prompts) * (tokens - 1)
            found[groups].append({"first byte s": first, "bytes/s": decoded / (outcome.seconds - first)})
    if rank == world - 1:
        Path(out).write_text(json.dumps(found))
    comms.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
