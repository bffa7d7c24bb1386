"""pipeclock against ``torch.distributed.pipelining`` at pp 2 x tp 2: the same tensor-parallel stages.

    python -m benchmarks.tensor_parallel            # starts torchrun on 4 ranks; writes
                                                    # benchmarks/results/tensor_parallel.json
    python -m benchmarks.tensor_parallel --smallest --out /tmp/tp.json  # a quick check
    python -m benchmarks.tensor_parallel --pin --steps 32   # rank r on core r mod cores, 32 rounds

Four gloo processes on the CPU form one ``(dp 1, pp 2, tp 2)`` mesh (``parallel.init_mesh``). For each
model, the GPT and a Hugging Face Llama, every rank builds its stage once per engine from the same seed
and splits every copy with ``parallel.tensor_parallel``: the model's own plan, torch's
``parallelize_module``, the same mesh. Two copies run under pipeclock's ``Pipeline`` (see below), one
under torch's ``PipelineStage`` over the mesh's ``"pp"`` group and ``Schedule1F1B``; all take the same
batch, 1F1B, the same micro-batches. The engines take turns step by step, another one first in each
round, so a change in the machine's load falls on all of them. A step's time runs from the earliest
rank's start to the latest rank's end (every rank starts after a barrier); a ratio pipeclock / torch is
the median over rounds of the ratio of the two engines' steps in the same round, given beside the ratio
of the median steps, the ratio of the CPU time all ranks spent (what each engine asks of the cores,
whoever else uses them) and the steps that other processes left quiet (``benchmarks.load``).

pipeclock runs as it ships, and again with its activation meter off: it checks that a stage's tp ranks
were given the same batch and meters activations, which torch's schedule does not. The GPT's embedding
and head are one tied matrix with a copy at each end: pipeclock sums the copies' gradients every step,
and torch's side does the same after its step (each tp rank its own rows, over the pp group), so both
compute the same gradients. Neither optimizer steps: the weights stay the same, so every step of both
engines has the same loss, checked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.tensor import DTensor

from benchmarks import load
from benchmarks.gpt import StageArguments
from benchmarks.launch import ROOT, torchrun
from benchmarks.summary import quiet_median
from pipeclock import comms, parallel, schedule
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.ties import tie_key
from pipeclock.models import gpt, hf

RESULTS = ROOT / "benchmarks" / "results" / "tensor_parallel.json"
TP = 2
METER_OFF = "pipeclock, meter off"
ENGINES = ("pipeclock", METER_OFF, "torch")


@dataclass(frozen=True)
class Setting:
    """A run's sizes: both models, the batch, and the steps."""

    dim: int
    layers: int  # blocks of each model (half on each stage)
    heads: int
    tokens: int
    batch: int
    microbatches: int
    warmup: int  # steps of each engine before the timed ones
    steps: int  # timed steps of each engine


FULL = Setting(dim=256, layers=4, heads=8, tokens=128, batch=16, microbatches=4, warmup=2, steps=16)
SMALLEST = Setting(dim=32, layers=2, heads=2, tokens=16, batch=4, microbatches=2, warmup=1, steps=2)


def gpt_stage(
    setting: Setting, stage: int, stages: int
) -> tuple[nn.Module, dict[str, str], TokenCrossEntropy]:
    config = gpt.GPTConfig(
        dim=setting.dim, layers=setting.layers, heads=setting.heads, seq_len=setting.tokens, seed=0
    )
    (chunk,) = gpt.GPT.for_rank(config, stage, stages)
    return chunk, gpt.tp_plan(config, TP), TokenCrossEntropy()


def llama_stage(
    setting: Setting, stage: int, stages: int
) -> tuple[nn.Module, dict[str, str], TokenCrossEntropy]:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=setting.dim, intermediate_size=setting.dim * 11 // 4, num_hidden_layers=setting.layers,
        num_attention_heads=setting.heads, num_key_value_heads=TP, vocab_size=256,
        max_position_embeddings=setting.tokens,
    )  # fmt: skip
    return hf.split(config, stage, stages, seed=0), hf.tp_plan(config, TP), hf.loss()


MODELS = {"gpt": gpt_stage, "llama": llama_stage}
MESSAGE_KEYS = {"llama": ("hidden", "input_ids")}  # a Llama stage hands on a dict (the GPT a tuple)


class Pipeclock:
    """pipeclock's ``Pipeline`` over the mesh's pp group: as it ships (its activation meter on), or with
    the meter off, which shows what the meter costs."""

    def __init__(self, chunk: nn.Module, loss: TokenCrossEntropy, mesh, setting: Setting, metered: bool):
        self.module, self.name = chunk, "pipeclock" if metered else METER_OFF
        self.pipe = schedule.Pipeline(
            [chunk], "1f1b", setting.microbatches, loss, group=mesh.get_group("pp"), measure_memory=metered
        )

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> float | None:
        return self.pipe.step(ids, targets)


class Torch:
    """torch's ``PipelineStage`` over the mesh's pp group, run by its ``Schedule1F1B``."""

    name = "torch"

    def __init__(
        self, chunk: nn.Module, loss: TokenCrossEntropy, mesh, setting: Setting, keys: tuple[str, ...] = ()
    ):
        self.module = chunk
        stage, stages = parallel.pp_rank(mesh), mesh["pp"].size()
        self.first, self.last = stage == 0, stage == stages - 1
        wrapped = StageArguments(chunk, keys)  # one argument, contiguous outputs for gloo
        pipe_stage = pipelining.PipelineStage(
            wrapped, stage, stages, comms.device(), group=mesh.get_group("pp")
        )
        self.schedule = pipelining.Schedule1F1B(pipe_stage, setting.microbatches, loss_fn=loss.mean)
        self.tied = [p for p in chunk.parameters() if tie_key(p) is not None]  # the GPT's, at each end
        self.pp_group = mesh.get_group("pp")

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] | None = [] if self.last else None
        args = (ids,) if self.first else ()
        self.schedule.step(*args, target=targets if self.last else None, losses=losses, return_outputs=False)
        for parameter in self.tied:  # summed as pipeclock sums it: each tp rank its rows of the matrix
            dist.all_reduce(_local(parameter.grad), group=self.pp_group)
        return statistics.fmean(float(x.detach()) for x in losses) if losses else None


@dataclass
class Sample:
    """One rank's step of one engine (picklable: gathered to every rank)."""

    start: float  # perf_counter: one clock for every process of the machine
    end: float
    cpu_s: float  # this process's CPU time during the step
    machine_busy_s: float | None  # the whole machine's busy CPU time during it (``benchmarks.load``)
    loss: float | None  # the batch loss, where this rank knows it


def timed_step(engine, ids: torch.Tensor, targets: torch.Tensor) -> Sample:
    """One step from freed gradients, after a barrier."""
    engine.module.zero_grad(set_to_none=True)
    comms.barrier("before a benchmark step")
    busy, cpu, start = load.busy_seconds(), time.process_time(), time.perf_counter()
    loss = engine.step(ids, targets)
    end, cpu, after = time.perf_counter(), time.process_time() - cpu, load.busy_seconds()
    return Sample(start, end, cpu, after - busy if busy is not None and after is not None else None, loss)


def compare(model: str, setting: Setting, mesh) -> dict:
    """The engines on one model, taking turns step by step, a different one first in each round (the
    one after another finds the heap and caches as that one left them); every rank's samples of the
    timed rounds, joined on every rank."""
    stage, stages = parallel.pp_rank(mesh), mesh["pp"].size()
    engines = []
    for make in (
        lambda *built: Pipeclock(*built, metered=True),
        lambda *built: Pipeclock(*built, metered=False),
        lambda *built: Torch(*built, keys=MESSAGE_KEYS.get(model, ())),
    ):
        chunk, plan, loss = MODELS[model](setting, stage, stages)
        parallel.tensor_parallel([chunk], mesh, plan)
        engines.append(make(chunk, loss, mesh, setting))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (setting.batch, setting.tokens), generator=generator)
    targets = ids if model == "llama" else torch.randint(0, 256, ids.shape, generator=generator)
    samples: dict[str, list[Sample]] = {engine.name: [] for engine in engines}
    for index in range(setting.warmup + setting.steps):
        turn = index % len(engines)
        for engine in engines[turn:] + engines[:turn]:
            sample = timed_step(engine, ids, targets)
            if index >= setting.warmup:
                samples[engine.name].append(sample)
    everyone = comms.all_gather_object(samples, "gathering the benchmark's samples")
    row = figures(model, everyone)
    apart = comms.all_gather_object(
        gradients_apart(engines[0], engines[-1]), "gathering the gradients' distance"
    )
    return row | {"gradients_apart": max(apart)}


def gradients_apart(ours, theirs) -> float:
    """The largest difference between the two engines' gradients on this rank, relative to the largest
    gradient: both ran the same step last, on the same weights (each tp rank compares its own shards)."""
    pairs = [
        (_local(a.grad), _local(b.grad))
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    ]
    largest = max(float(a.abs().max()) for a, _ in pairs)
    return max(float((a - b).abs().max()) for a, b in pairs) / largest


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def figures(model: str, everyone: list[dict[str, list[Sample]]]) -> dict:
    """Per engine, each timed step's wall time (earliest start to latest end over the ranks), the
    ranks' CPU time and the foreign load (``benchmarks.summary``); their medians, over quiet steps too.
    Each pipeclock's ratio to torch is the median over rounds of the two steps' ratio (the same round),
    beside the ratio of the medians and of the CPU times. The losses any rank saw agree (the weights
    never change)."""
    row: dict = {"model": model}
    walls = {}
    for name in ENGINES:
        steps = list(zip(*(samples[name] for samples in everyone), strict=True))
        walls[name] = [max(s.end for s in step) - min(s.start for s in step) for step in steps]
        cpu = [sum(s.cpu_s for s in step) for step in steps]
        shares = [_foreign_share(step, wall) for step, wall in zip(steps, walls[name], strict=True)]
        quiet = quiet_median(walls[name], shares)
        row[name] = {
            "step_ms": [round(w * 1e3, 2) for w in walls[name]],
            "median_ms": round(statistics.median(walls[name]) * 1e3, 2),
            "quiet_median_ms": round(quiet * 1e3, 2) if quiet is not None else None,
            "quiet_steps": sum(share is not None and share < load.QUIET for share in shares),
            "cpu_median_ms": round(statistics.median(cpu) * 1e3, 2),
            "foreign_share": [round(share, 3) if share is not None else None for share in shares],
        }
    for name in ENGINES[:-1]:
        pairs = [ours / theirs for ours, theirs in zip(walls[name], walls["torch"], strict=True)]
        row[name] |= {
            "ratio_of_pairs": round(statistics.median(pairs), 3),
            "ratio_of_medians": round(row[name]["median_ms"] / row["torch"]["median_ms"], 3),
            "cpu_ratio": round(row[name]["cpu_median_ms"] / row["torch"]["cpu_median_ms"], 3),
        }
    seen = [s.loss for samples in everyone for found in samples.values() for s in found if s.loss is not None]
    row["loss"] = seen[0]
    row["loss_spread"] = (max(seen) - min(seen)) / abs(seen[0])
    return row


def _foreign_share(step: tuple[Sample, ...], wall: float) -> float | None:
    """The share of the machine's cores that other processes than our ranks used during ``step``."""
    busy = step[0].machine_busy_s
    if busy is None or wall <= 0:
        return None
    return max(0.0, busy - sum(s.cpu_s for s in step)) / (load.cores() * wall)


def worker(setting: Setting, output: Path, pin: bool) -> None:
    rank, world = comms.init()
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if pin:  # rank r on core r mod cores: a stage's tp ranks side by side, the stages taking turns
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    mesh = parallel.init_mesh(1, TP)
    rows = [compare(model, setting, mesh) for model in MODELS]
    if rank == 0:
        meta = {
            "layout": f"dp 1 x pp {world // TP} x tp {TP}, gloo on the CPU, 1 thread per process",
            "cores": len(cores),
            "pinned": pin,
            "torch": torch.__version__,
            "setting": setting.__dict__,
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    comms.shutdown()


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | engine | step (median) | / torch (pairs) | of the medians | CPU time, all ranks "
        "| CPU / torch's | quiet steps | loss (spread) | gradients apart |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        for name in ENGINES:
            mine = row[name]
            ratios = (
                f"| {mine['ratio_of_pairs']:.3f} | {mine['ratio_of_medians']:.3f} "
                if name != "torch"
                else "| | "
            )
            lines.append(
                f"| {row['model']} | {name} | {mine['median_ms']:.1f} ms {ratios}"
                f"| {mine['cpu_median_ms']:.0f} ms | {mine.get('cpu_ratio', 1.0):.3f} "
                f"| {mine['quiet_steps']} of {len(mine['step_ms'])} "
                f"| {row['loss']:.6f} ({row['loss_spread']:.1e}) | {row['gradients_apart']:.1e} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smallest", action="store_true", help="tiny models and 2 timed steps (a check)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results' JSON file")
    parser.add_argument("--steps", type=int, help=f"timed rounds (default {FULL.steps})")
    parser.add_argument(
        "--pin", action="store_true", help="rank r on core r mod cores (the same for every engine)"
    )
    args = parser.parse_args()
    setting = SMALLEST if args.smallest else FULL
    setting = replace(setting, steps=args.steps) if args.steps else setting
    if args.worker:
        worker(setting, args.out, args.pin)
        return
    argv = ["--worker", "--out", str(args.out), *(["--smallest"] if args.smallest else [])]
    argv += [*(["--steps", str(args.steps)] if args.steps else []), *(["--pin"] if args.pin else [])]
    torchrun("benchmarks.tensor_parallel", 2 * TP, argv, timeout=1800)
    results = json.loads(args.out.read_text())
    print("\n".join(table(results["rows"])))


if __name__ == "__main__":
    main()
