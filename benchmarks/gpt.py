"""GPT tokens per second: pipeclock against ``torch.distributed.pipelining`` on the same stage modules.

    python -m benchmarks.gpt            # starts torchrun itself (2 ranks), writes benchmarks/results/gpt.*

Both engines train the main job's default GPT (4 blocks x 128, sequences of 128 bytes, batch 16) on the
default corpus, each on its own copy of the rank's pieces built from the same seed. A step of one engine
alternates with a step of the other, so a disturbance of the machine hits both; the first steps warm up
and are not counted. A step's time is the slowest rank's. torch's stage is given the pieces behind a thin
adapter (its stages call ``module(*args)``; pipeclock's pieces take the tuple ``(hidden, positions)``
whole), its loss is the mean cross-entropy per micro-batch with ``scale_grads`` (equal micro-batches: the
same batch mean), and ``return_outputs=False``. The GPT's head is tied to its embedding, one copy on each
end: pipeclock sums the copies' gradients every step (``SUM_TIED``), and torch's side does the same after
its step with one all-reduce, so that both engines train the same model.

- ``1f1b`` against ``Schedule1F1B``;
- ``zb-h1`` against ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB-H1's order).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.launch import ROOT, torchrun

RESULTS = ROOT / "benchmarks" / "results"
SCHEDULES = {"1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble"}
MICROBATCHES = (4, 8)
BATCH, SEQ_LEN = 16, 128
ENGINES = ("pipeclock", "torch", "pipeclock, meter off")


class StageArguments(nn.Module):
    """torch's stage calls ``module(*args)``; the GPT's pieces take their ``(hidden, positions)`` whole.

    torch sends outputs as they are, and gloo refuses a non-contiguous tensor (the expanded positions),
    so the adapter hands on contiguous ones; pipeclock's sends do the same themselves. torch's stages
    send tensors and tuples only: a stage whose message is a dict (a Hugging Face stage's hidden states
    and token ids) sends its values in the order of ``keys``, and the next stage's adapter, given the
    same ``keys``, makes the dict again.
    """

    def __init__(self, chunk: nn.Module, keys: tuple[str, ...] = ()):
        super().__init__()
        self.chunk, self.keys = chunk, keys

    def forward(self, *args):
        if self.keys and len(args) == len(self.keys):
            output = self.chunk(dict(zip(self.keys, args, strict=True)))
        else:
            output = self.chunk(args[0] if len(args) == 1 else args)
        if isinstance(output, dict):
            return tuple(output[key].contiguous() for key in self.keys)
        return tuple(t.contiguous() for t in output) if isinstance(output, tuple) else output


def _mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _slowest(seconds: float) -> float:
    from pipeclock import comms

    gathered = comms.all_gather(torch.tensor([seconds], dtype=torch.float64), "gathering step times")
    return max(float(t) for t in gathered)


def _engines(name: str, m: int):
    """Steps of pipeclock (as it ships, and with its activation meter off) and of torch, each a function
    of (ids, targets) on its own modules."""
    from torch.distributed import pipelining

    from pipeclock import comms, schedule
    from pipeclock.engine.ties import tie_key
    from pipeclock.models.gpt import GPT, GPTConfig

    rank, world = comms.get_rank(), comms.get_world_size()
    config = GPTConfig(seq_len=SEQ_LEN)
    ours = GPT.for_rank(config, rank, world)
    pipe = schedule.Pipeline(ours, name, m, schedule.TokenCrossEntropy())
    bare = GPT.for_rank(config, rank, world)
    unmetered = schedule.Pipeline(bare, name, m, schedule.TokenCrossEntropy(), measure_memory=False)
    stage = pipelining.PipelineStage(
        StageArguments(GPT.for_rank(config, rank, world)[0]), rank, world, comms.device()
    )
    kind = getattr(pipelining, SCHEDULES[name])
    multi = issubclass(kind, pipelining.schedules.PipelineScheduleMulti)
    theirs = kind([stage] if multi else stage, m, loss_fn=_mean_cross_entropy)
    tied = [p for p in stage.submod.parameters() if tie_key(p) is not None]  # one copy on each of 2 ranks
    optimizers = [
        torch.optim.Adam(p, lr=3e-3) for p in (_params(ours), stage.submod.parameters(), _params(bare))
    ]

    def pipeclock_step(ids, targets) -> float:
        optimizers[0].zero_grad()
        loss = pipe.step(ids, targets)
        optimizers[0].step()
        return loss

    def unmetered_step(ids, targets) -> float:
        optimizers[2].zero_grad()
        loss = unmetered.step(ids, targets)
        optimizers[2].step()
        return loss

    def torch_step(ids, targets) -> float | None:
        optimizers[1].zero_grad()
        losses: list[torch.Tensor] | None = [] if stage.is_last else None
        args = (ids,) if stage.is_first else ()
        theirs.step(*args, target=targets if stage.is_last else None, losses=losses, return_outputs=False)
        for parameter in tied:  # the tie, summed as pipeclock sums it: the same model on both engines
            torch.distributed.all_reduce(parameter.grad)
        optimizers[1].step()
        return statistics.fmean(float(x.detach()) for x in losses) if losses else None

    return pipeclock_step, torch_step, unmetered_step


def _params(chunks):
    return [p for chunk in chunks for p in chunk.parameters()]


def worker(steps: int, warmup: int, output: Path) -> None:
    """On every rank: both engines, step by step in turn; rank 0 writes the step times."""
    from pipeclock import comms
    from pipeclock.models.text import TextCorpus

    comms.init()
    corpus, results = TextCorpus.default(), []
    for name in SCHEDULES:
        for m in MICROBATCHES:
            engines = dict(zip(ENGINES, _engines(name, m), strict=True))
            times: dict[str, list[float]] = {engine: [] for engine in engines}
            first_losses: dict[str, float | None] = {}
            for step in range(warmup + steps):
                ids, targets = corpus.batch(step, BATCH, SEQ_LEN)
                order = list(engines)[step % 3 :] + list(engines)[: step % 3]  # each engine in each slot
                for engine in order:
                    comms.barrier("starting a timed step")
                    start = time.perf_counter()
                    loss = engines[engine](ids, targets)
                    seconds = _slowest(time.perf_counter() - start)
                    first_losses.setdefault(engine, loss)
                    if step >= warmup:
                        times[engine].append(seconds)
            results.append({"schedule": name, "torch": SCHEDULES[name], "m": m, "times": times,
                            "first_losses": first_losses})  # fmt: skip
    if comms.get_rank() == 0:
        output.write_text(json.dumps({"batch": BATCH, "seq_len": SEQ_LEN, "cases": results}, indent=1))
    comms.shutdown()


def table(data: dict) -> list[str]:
    """The markdown table: median step, tokens per second, and the ratio, per schedule and m."""
    tokens = data["batch"] * data["seq_len"]
    lines = [
        "| schedule (torch's) | m | pipeclock step | torch step | pipeclock tokens/s | torch tokens/s "
        "| pipeclock / torch (time) | pipeclock, meter off / torch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in data["cases"]:
        ours, theirs, bare = (statistics.median(case["times"][e]) for e in ENGINES)
        steps = f"{ours * 1e3:.1f} ms | {theirs * 1e3:.1f} ms"
        rates = f"{tokens / ours:,.0f} | {tokens / theirs:,.0f}"
        name = f"{case['schedule']} ({case['torch']})"
        lines.append(
            f"| {name} | {case['m']} | {steps} | {rates} | {ours / theirs:.3f} | {bare / theirs:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per engine and case")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "gpt.json")
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.warmup, args.out)
        return
    argv = ["--worker", "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(args.out)]
    torchrun("benchmarks.gpt", 2, argv, timeout=1800)
    data = json.loads(args.out.read_text())
    text = "\n".join(table(data))
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
