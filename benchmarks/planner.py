"""The planner against real runs: predicted and measured per-rank memory and step time.

    python -m benchmarks.planner            # two ranks; writes benchmarks/results/planner.{json,md}
    python -m benchmarks.planner --quick    # fewer steps, for a smoke run
    python -m benchmarks.planner --models gpt-vocab --rounds 10 --steps 4 --name planner-balance

For each model (the MLP, the GPT) and schedule, both ranks build their stage, train a few steps with
Adam and measure: the activation meter's peak, the growth of the process's resident memory from just
before the stage is built to its high-water mark (``VmHWM``), and the step time (the slowest rank's
``Pipeline.step``, median over the timed steps). Right before each case every rank profiles each layer
kind (one thread, the micro-batch the run uses, all ranks at once as in the run, so a busy machine
slows both alike), and the planner predicts the same three figures from the ranks' mean profile.

Memory and time are measured in separate launches, memory in one launch per case: a process that ran
other cases first keeps their heap, and its high-water mark would carry their history (a GPT's ZB-H1
grew by 22 / 27 MiB after the other cases, by 18.8 / 24 MiB in five launches of its own). Memory is
read with glibc's mmap threshold fixed
low (``MALLOC_MMAP_THRESHOLD_``, 16 KiB): by default glibc raises it as large blocks are freed, after
which freed tensors stay in its heap, and a heap shared by many small tensors fragments, so the
high-water mark counts memory the program no longer holds (3-6 MiB of a GPT rank's 20 at 128 KiB).
Time is measured with glibc's default, which is how the engine runs.

What the engine holds whatever the model (its objects, gloo's buffers, the allocator's slack) is
measured the same way on a model too small to hold anything (``TINY``), once per schedule and way of
running, each in a launch of its own: its resident growth less what the planner gives that model. The
predicted memory adds it to every rank (``judge(runtime_memory=)``, ``plan --runtime-memory``).

Then the GPT with a real-sized vocabulary (4096 tokens: a head that costs more than a block) runs cut
by layer count and cut by time, to compare the gain the simulator predicts with the gain measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import rss
from benchmarks.launch import ROOT, torchrun
from benchmarks.planner_report import markdown
from benchmarks.worker import release_memory
from pipeclock import comms
from pipeclock.engine.actions import placement_of
from pipeclock.engine.generators import chunks_of, generate, get_schedule, supports_chunks
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.orchestrator import Pipeline
from pipeclock.models.gpt import GPT, GPTConfig
from pipeclock.models.mlp import ShardedMLP
from pipeclock.models.partition import partition
from pipeclock.observe.simulate import simulate
from pipeclock.plan.model_specs import gpt_spec, mlp_spec
from pipeclock.plan.planner import cut_for, judge
from pipeclock.plan.profile import profile
from pipeclock.plan.rank_memory import Recompute, Training

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev")
MICROBATCHES = 8
MMAP_THRESHOLD = 16 * 1024  # bytes: every block this large or larger is its own mapping


@dataclass(frozen=True)
class Model:
    name: str
    kind: str  # "mlp" or "gpt"
    batch: int
    hidden: int = 1024
    layers: int = 16
    gpt: GPTConfig | None = None

    def spec(self):
        return gpt_spec(self.gpt) if self.kind == "gpt" else mlp_spec(self.hidden, self.layers)

    def build(self, rank: int, world: int, table, cut) -> list[torch.nn.Module]:
        placement = placement_of(table)
        chunks = len(placement.stages[rank])
        if self.kind == "gpt":
            return GPT.for_rank(self.gpt, rank, world, chunks, placement, cut)
        return ShardedMLP.for_rank(self.hidden, self.layers, rank, world, chunks, 0, placement, cut)

    def batch_data(self, step: int):
        generator = torch.Generator().manual_seed(step)
        if self.kind == "gpt":
            ids = torch.randint(
                0, self.gpt.vocab_size, (self.batch, self.gpt.seq_len + 1), generator=generator
            )
            return ids[:, :-1], ids[:, 1:], TokenCrossEntropy()
        x = torch.randn(self.batch, self.hidden, generator=generator)
        return x, torch.randn(self.batch, self.hidden, generator=generator), F.mse_loss


TINY = Model("ShardedMLP 16 x 16 (the engine alone)", "mlp", batch=256, hidden=16)
MODELS = {
    "tiny": TINY,
    "mlp": Model("ShardedMLP 16 x 1024, batch 256", "mlp", batch=256),
    "gpt": Model("GPT 4 blocks x 128 (vocab 256, seq 128), batch 16", "gpt", batch=16, gpt=GPTConfig()),
    "gpt-vocab": Model(
        "GPT 4 blocks x 128 (vocab 4096, seq 128), batch 16", "gpt", batch=16, gpt=GPTConfig(vocab_size=4096)
    ),
}


@dataclass(frozen=True)
class Variant:
    """How the stages run beside the schedule: the compute dtype and the activation recompute."""

    dtype: str = "fp32"
    recompute: str = "none"

    @classmethod
    def parse(cls, text: str) -> Variant:
        dtype, _, recompute = text.partition("/")
        return cls(dtype, recompute or "none")

    @property
    def training(self) -> Training:
        return Training(self.dtype, "adam", Recompute.parse(self.recompute))

    @property
    def pipeline_options(self) -> dict:
        return {"dtype": self.dtype, "recompute": self.recompute}

    def __str__(self) -> str:
        return f"{self.dtype}/{self.recompute}"


PLAIN = Variant()
VARIANTS = ("fp32/none", "fp32/full", "fp32/every-2", "bf16/none", "bf16/full")


def table_for(schedule: str, world: int, m: int):
    chunks = chunks_of(schedule) or (2 if supports_chunks(get_schedule(schedule)) else 1)
    return generate(schedule, world, m, chunks)


def measure_memory(model: Model, variant: Variant, schedule: str, cut, steps: int):
    """Build this rank's stage, train ``steps`` steps; the meter's peak and the resident growth.

    Returns the pipeline and its optimizer too, for the timed rounds that follow.
    """
    rank, world = comms.get_rank(), comms.get_world_size()
    release_memory()
    comms.barrier("lining up before a case")
    base = rss.current_bytes()
    rss.reset_peak()
    table = table_for(schedule, world, MICROBATCHES)
    modules = model.build(rank, world, table, cut)
    built = rss.peak_bytes() - base
    inputs, targets, loss_fn = model.batch_data(0)
    pipe = Pipeline(modules, table, MICROBATCHES, loss_fn, **variant.pipeline_options)
    seen = {id(p): p for m in modules for p in m.parameters()}
    optimizer = torch.optim.Adam(list(seen.values()), lr=1e-4)
    peaks, growth = [], []
    for _ in range(steps):
        peaks.append(_train_step(pipe, optimizer, inputs, targets))
        growth.append(rss.peak_bytes() - base)
    measured = {
        "rank": rank,
        "activations": max(peaks),
        "rss_growth": growth[-1],
        "rss_steps": [built, *growth],
    }
    return measured, (pipe, optimizer, inputs, targets)


def _train_step(pipe: Pipeline, optimizer, inputs, targets) -> int:
    optimizer.zero_grad(set_to_none=True)
    comms.barrier("lining up before a step")
    pipe.step(inputs, targets)
    optimizer.step()
    return pipe.last.peak_activation_bytes


def timed_rounds(
    model: Model, variant: Variant, schedule: str, cases: dict, rounds: int, steps: int
) -> dict[str, list[dict]]:
    """Rounds of (a fresh profile and engine overhead, then ``steps`` timed steps of each case in turn):
    each round's prediction beside what it measured, so a machine whose speed drifts is judged round by
    round, and cases run side by side (``cases``: name -> (cut, running pipeline)) see the same machine."""
    found: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(rounds):
        layers = shared_profile(model, variant)
        overhead = engine_overhead(variant, schedule)
        predicted = {
            name: _predicted_step(layers, variant, schedule, cut, overhead)
            for name, (cut, _) in cases.items()
        }
        layers_only = {
            name: _predicted_step(layers, variant, schedule, cut, 0.0) for name, (cut, _) in cases.items()
        }
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(steps):
            for name, (_, (pipe, optimizer, inputs, targets)) in cases.items():
                _train_step(pipe, optimizer, inputs, targets)
                seconds[name].append(max(comms.all_gather_object(pipe.last.seconds, "sharing step times")))
        for name in cases:
            found[name].append(
                {
                    "predicted_s": predicted[name],
                    "layers_only_s": layers_only[name],
                    "action_overhead_s": overhead,
                    "measured_s": statistics.median(seconds[name]),
                    "steps_s": seconds[name],
                    "load": os.getloadavg()[0],  # the machine's 1-minute load (2 cores here)
                }
            )
    return found


def _predicted_step(layers, variant: Variant, schedule: str, cut, action_overhead: float) -> float:
    world = comms.get_world_size()
    plan = judge(
        layers, schedule, world, MICROBATCHES, variant.training, cut=cut, action_overhead=action_overhead
    )
    return plan.step_time


def engine_overhead(variant: Variant, schedule: str, steps: int = 10) -> float:
    """The engine's own time per action on this machine, over gloo: the step of ``TINY`` (whose layers
    cost next to nothing) divided by the schedule's makespan in actions, each action costing 1."""
    world = comms.get_world_size()
    table = table_for(schedule, world, MICROBATCHES)
    placement = placement_of(table)
    cut = partition(TINY.layers, placement.num_virtual)
    modules = TINY.build(comms.get_rank(), world, table, cut)
    inputs, targets, loss_fn = TINY.batch_data(0)
    pipe = Pipeline(modules, table, MICROBATCHES, loss_fn, **variant.pipeline_options)
    seconds = []
    for step in range(steps + 2):
        comms.barrier("lining up before a step of the tiny model")
        pipe.step(inputs, targets)
        if step >= 2:  # the first steps warm up
            seconds.append(max(comms.all_gather_object(pipe.last.seconds, "sharing step times")))
    return statistics.median(seconds) / simulate(table, dict.fromkeys("FBIW", 1.0)).makespan


def shared_profile(model: Model, variant: Variant = PLAIN) -> list:
    """Every rank profiles the model at once (as busy as in the run), then all take the ranks' mean."""
    samples = model.batch // MICROBATCHES
    mine = profile(model.spec(), samples, dtype=variant.dtype)
    everyone = comms.all_gather_object(mine, "sharing the profiles")
    times = ("forward", "backward", "input_grad", "weight_grad")
    return [
        replace(layer, **{t: statistics.fmean(getattr(ranks[i], t) for ranks in everyone) for t in times})
        for i, layer in enumerate(everyone[0])
    ]


def worker(args: argparse.Namespace) -> None:
    """Each model and schedule, after a fresh profile: its memory (``--phase memory``) or its timed
    rounds (``--phase time``); the launcher runs each phase in its own processes. The two cuts of the
    GPT with a large vocabulary are timed side by side, step for step."""
    rank, world = comms.init(timeout=300.0)
    out = []
    cases = list(_cases(args))
    for key, variant, schedule in cases if args.case is None else [cases[args.case]]:
        model = MODELS[key]
        balances = ("layers", "time") if key == "gpt-vocab" else ("layers",)
        layers = shared_profile(model, variant)
        num_virtual = placement_of(table_for(schedule, world, MICROBATCHES)).num_virtual
        cuts = {balance: cut_for(layers, num_virtual, balance, variant.training) for balance in balances}
        memory, running = {}, {}
        for balance, cut in cuts.items():
            steps = 2 if args.phase == "memory" else 1
            memory[balance], running[balance] = measure_memory(model, variant, schedule, cut, steps)
            if args.phase == "memory":
                running.pop(balance)  # measured alone: free it before the next
        timed = {}
        if args.phase == "time":
            cases = {balance: (cuts[balance], running[balance]) for balance in cuts}
            timed = timed_rounds(model, variant, schedule, cases, args.rounds, args.steps)
        running.clear()
        for balance, cut in cuts.items():
            ranks = comms.gather_object(memory[balance], "gathering a case")
            if rank == 0:
                rounds = timed.get(balance, [])
                out.append(_record(key, model, variant, schedule, balance, layers, cut, ranks, rounds))
    if rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    comms.barrier("finishing")
    comms.shutdown()


def _cases(args: argparse.Namespace):
    """(model, variant, schedule) in the order they run: every variant of the MLP and the GPT, then the
    large-vocabulary GPT's two cuts, in float32 without recompute."""
    for key in args.models:
        if key == "gpt-vocab":
            yield key, PLAIN, "1f1b"
            continue
        for variant in map(Variant.parse, args.variants):
            for schedule in SCHEDULES:
                yield key, variant, schedule


def _record(
    key: str, model: Model, variant: Variant, schedule: str, balance: str, layers, cut, ranks, rounds
) -> dict:
    plan = judge(layers, schedule, len(ranks), MICROBATCHES, variant.training, cut=cut, simulated=False)
    if not rounds:  # the memory phase
        return {
            "activations": [m.activations for m in plan.memory],
            "total": [m.total for m in plan.memory],
            "parts": [m.parts for m in plan.memory],
            "measured_activations": [r["activations"] for r in ranks],
            "rss_growth": [r["rss_growth"] for r in ranks],
            "rss_steps": [r["rss_steps"] for r in ranks],
        }
    return {
        "model": key,
        "description": model.name,
        "schedule": schedule,
        "dtype": variant.dtype,
        "recompute": variant.recompute,
        "balance": balance,
        "cut": [[part.start, part.stop] for part in cut],
        "predicted": {
            "step_s": statistics.median(r["predicted_s"] for r in rounds),
            "layers_only_s": statistics.median(r["layers_only_s"] for r in rounds),
            "action_overhead_s": statistics.median(r["action_overhead_s"] for r in rounds),
        },
        "measured": {"step_s": statistics.median(r["measured_s"] for r in rounds)},
        "step_ratio": statistics.median(r["predicted_s"] / r["measured_s"] for r in rounds),
        "rounds": rounds,
    }


@contextlib.contextmanager
def _malloc_threshold(threshold: int | None):
    """Launch with glibc's mmap threshold fixed (memory phase) or glibc's own (time phase: a fixed
    threshold maps and zeroes every large tensor afresh, which slows layers down by a factor of three)."""
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    try:
        yield
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _merged(timed: dict, memory: dict, runtime: dict) -> dict:
    """One configuration's record: its timed rounds, its memory, and (beside the model's) the memory the
    engine holds per rank, as measured for its schedule and way of running."""
    record = dict(timed)
    way = f"{timed['dtype']}/{timed['recompute']}"
    held = runtime.get((way, timed["schedule"]), [0] * len(memory["total"]))
    predicted = {
        "activations": memory["activations"],
        "model_total": memory["total"],
        "runtime": held,
        "total": [total + extra for total, extra in zip(memory["total"], held, strict=True)],
        "parts": [parts | {"runtime": extra} for parts, extra in zip(memory["parts"], held, strict=True)],
    }
    record["predicted"] = {**timed["predicted"], **predicted}
    record["measured"] = {
        **timed["measured"],
        "activations": memory["measured_activations"],
        "rss_growth": memory["rss_growth"],
        "rss_after_build_and_each_step": memory["rss_steps"],
    }
    return record


def _runtime(scratch: Path, variant: Variant, schedules: set[str]) -> dict[tuple[str, str], list[int]]:
    """What the engine holds per rank whatever the model, for ``variant`` and each schedule: the tiny
    model's resident growth less the planner's figure for it, in a launch of its own per schedule."""
    found = {}
    for case, schedule in enumerate(SCHEDULES):
        if schedule in schedules:
            extra = ["--models", "tiny", "--variants", str(variant), "--phase", "memory", "--case", str(case)]
            (record,) = _launch(scratch, extra, 300)
            growth = zip(record["rss_growth"], record["total"], strict=True)
            found[(str(variant), schedule)] = [measured - predicted for measured, predicted in growth]
    return found


def _launch(scratch: Path, extra: list[str], timeout: float) -> list[dict]:
    """One launch of the worker on two ranks; the records it wrote."""
    out = scratch / "records.json"
    torchrun("benchmarks.planner", 2, ["--worker", "--out", str(out), *extra], timeout=timeout)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("memory", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)  # the index of the one case to run
    models = [key for key in MODELS if key != "tiny"]
    parser.add_argument("--models", nargs="+", default=models, choices=list(MODELS))
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), metavar="DTYPE/RECOMPUTE",
        help=f"how the stages run, each over every schedule (default {' '.join(VARIANTS)})",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case, each after a profile")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--quick", action="store_true", help="two rounds of one step per case")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="planner", help="results file name (default planner)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rounds, steps = (2, 1) if args.quick else (args.rounds, args.steps)
    command = shlex.join(
        ["python", "-m", "benchmarks.planner", *(argv if argv is not None else sys.argv[1:])]
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipeclock-planner-") as scratch:
        common = ["--models", *args.models, "--variants", *args.variants]
        common += ["--rounds", str(rounds), "--steps", str(steps)]
        memory, runtime = [], {}
        with _malloc_threshold(MMAP_THRESHOLD):
            for case in range(len(list(_cases(args)))):
                memory += _launch(Path(scratch), [*common, "--phase", "memory", "--case", str(case)], 600)
            for variant in {str(v): v for _, v, _ in _cases(args)}.values():
                runtime |= _runtime(Path(scratch), variant, {s for _, v, s in _cases(args) if v == variant})
        with _malloc_threshold(None):
            timed = _launch(Path(scratch), [*common, "--phase", "time"], 1800)
        records = [_merged(t, m, runtime) for t, m in zip(timed, memory, strict=True)]
    seconds = time.perf_counter() - start
    loads = [r["load"] for record in records for r in record["rounds"]]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.name}.json").write_text(
        json.dumps({"command": command, "seconds": seconds, "loads": loads, "records": records}, indent=1)
        + "\n"
    )
    page = markdown(records, command, seconds, loads, MICROBATCHES, TINY.name)
    (args.results_dir / f"{args.name}.md").write_text(page)
    print(f"wrote {args.results_dir / args.name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
