"""``torchrun --nproc-per-node 2 -m benchmarks.hf_engines``: an HF Llama's tokens per second, two engines.

The same stage modules (``hf.split`` of one Llama config, the same weights) run under pipeclock's
``Pipeline`` and under ``torch.distributed.pipelining``'s manual ``PipelineStage`` with its own schedule
(``Schedule1F1B``, ``ScheduleZBVZeroBubble``), on two ranks, with batches without padding (torch's stages
send the hidden states alone). Each case: warm-up steps, then the median step time of the timed ones.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from torch.distributed import pipelining

from pipeclock import comms, schedule
from pipeclock.engine.placement import Placement
from pipeclock.models import hf

STEPS, WARMUP = 12, 3
BATCH, TOKENS, MICROBATCHES = 16, 128, 4
CASES = {"1f1b": ("Schedule1F1B", 1, "loop"), "zb-v": ("ScheduleZBVZeroBubble", 2, "v")}


def config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=TOKENS,
    )  # fmt: skip


class OneArgument(nn.Module):
    """torch's stages call ``module(*inputs)``; an HF stage takes its inputs as one argument."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *inputs):
        return self.stage(inputs[0] if len(inputs) == 1 else inputs)


def chunks_for(rank: int, world: int, name: str) -> list[nn.Module]:
    _, chunks, placement = CASES[name]
    built = hf.split(config(), rank, world, chunks=chunks, placement=placement, seed=0)
    return built if isinstance(built, list) else [built]


def timed(step) -> float:
    times = []
    for index in range(WARMUP + STEPS):
        comms.barrier("between steps")
        start = time.perf_counter()
        step()
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    rank, world = comms.init()
    torch.set_num_threads(1)
    ids = torch.randint(0, 256, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    loss = hf.loss()
    for name, (torch_name, chunks, placement) in CASES.items():
        ours = chunks_for(rank, world, name)
        pipe = schedule.Pipeline(ours, name, MICROBATCHES, loss)
        mine = timed(lambda pipe=pipe: pipe.step(ids, ids))
        theirs_modules = [OneArgument(chunk) for chunk in chunks_for(rank, world, name)]
        places = Placement.named(placement, world, chunks)
        stages = [
            pipelining.PipelineStage(module, places.stage(rank, c), places.num_virtual, comms.device())
            for c, module in enumerate(theirs_modules)
        ]
        kind = getattr(pipelining, torch_name)
        multi = issubclass(kind, pipelining.schedules.PipelineScheduleMulti)
        runner = kind(stages if multi else stages[0], MICROBATCHES, loss_fn=loss.mean)
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

        def torch_step(runner=runner, first=first, last=last):
            runner.step(*((ids,) if first else ()), target=ids if last else None)

        theirs = timed(torch_step)
        if rank == 0:
            tokens = BATCH * TOKENS
            print(
                f"{name:5s} pipeclock {mine * 1e3:7.1f} ms/step {tokens / mine:8.0f} tokens/s   "
                f"torch {theirs * 1e3:7.1f} ms/step {tokens / theirs:8.0f} tokens/s   "
                f"ratio {mine / theirs:.3f}",
                flush=True,
            )
    comms.shutdown()


if __name__ == "__main__":
    main()
