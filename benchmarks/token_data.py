"""Token data: ``prepare``'s speed and memory; a training batch read from shards against one in memory.

    python -m benchmarks.token_data prepare SIZE_MB [--tokenizer DIR|bytes]   # a jsonl of stdlib sources
    python -m benchmarks.token_data batches                                   # batch fetch, shards vs memory
    python -m benchmarks.token_data steps                                     # a GPT step, the same

``prepare`` runs the command on a jsonl of the standard library's sources repeated to SIZE_MB (one
document per file per round), sampling the process tree every 0.1 s: wall time, CPU seconds and the
peak proportional set size (PSS) of all its processes, so that pages the workers share with the main
process are counted once. ``batches`` times ``batch(k)`` of the GPT's default shape (16 x 129) from the
default corpus in memory and from the same text prepared as bytes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def stdlib_jsonl(path: Path, megabytes: float) -> None:
    texts = []
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            texts.append(source.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    written, target, round_ = 0, megabytes * 1e6, 0
    with open(path, "w") as out:
        while written < target:
            for index, text in enumerate(texts):
                line = json.dumps({"text": f"# round {round_} file {index}\n{text}"}) + "\n"
                out.write(line)
                written += len(line)
                if written >= target:
                    break
            round_ += 1


def measured(argv: list[str]) -> dict:
    """Run ``argv``; its wall seconds, CPU seconds and peak PSS over its whole process tree."""
    import psutil

    started, process = time.perf_counter(), subprocess.Popen(argv)
    root, peak, cpu = psutil.Process(process.pid), 0, {}
    while process.poll() is None:
        total = 0
        for one in [root, *root.children(recursive=True)]:
            try:
                total += one.memory_full_info().pss
                times = one.cpu_times()
                cpu[one.pid] = times.user + times.system
            except psutil.Error:
                continue
        peak = max(peak, total)
        time.sleep(0.1)
    return {"seconds": time.perf_counter() - started, "cpu_seconds": sum(cpu.values()), "peak_pss": peak}


def prepare_run(megabytes: float, tokenizer: str, workers: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "docs.jsonl"
        stdlib_jsonl(source, megabytes)
        argv = [sys.executable, "-m", "pipeclock", "prepare", str(source), "--output", f"{scratch}/out",
                "--tokenizer", tokenizer, "--workers", str(workers),
                "--validation-fraction", "0.001"]  # fmt: skip
        found = measured(argv)
        size, wall, cpu = source.stat().st_size / 1e6, found["seconds"], found["cpu_seconds"]
        print(
            f"{size:.0f} MB with {tokenizer}: {wall:.1f} s wall ({size / wall:.1f} MB/s), "
            f"{cpu:.0f} CPU s ({size / cpu:.1f} MB per CPU second), "
            f"peak PSS {found['peak_pss'] / 2**20:.0f} MiB"
        )


def batches_run(repeats: int = 200) -> None:
    from pipeclock.data.prepare import prepare
    from pipeclock.data.tokens import TokenDataset
    from pipeclock.models.text import TextCorpus

    corpus = TextCorpus.default()
    with tempfile.TemporaryDirectory() as scratch:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        prepare([str(stdlib / name) for name in corpus.files], Path(scratch) / "out", validation_fraction=0.1)
        shards = TokenDataset(Path(scratch) / "out")
        for name, data in (("in memory", corpus), ("shards", shards)):
            started = time.perf_counter()
            for step in range(repeats):
                data.batch(step, 16, 128, seed=0)
            print(
                f"batch of 16 x 129 tokens, {name}: {(time.perf_counter() - started) / repeats * 1e6:.0f} us"
            )


def steps_run(steps: int = 20, rounds: int = 4) -> None:
    """The GPT's default run, one process: the time from one step's end to the next's (batch read, step,
    optimizer), from the corpus in memory and from the same files as shards, in alternating rounds; the
    fastest step is the figure a busy machine disturbs least."""
    import statistics

    from pipeclock import comms
    from pipeclock.data.prepare import prepare
    from pipeclock.models.text import TextCorpus
    from pipeclock.training.loop import TrainConfig, train

    corpus = TextCorpus.default()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with tempfile.TemporaryDirectory() as scratch:
        prepare([str(stdlib / name) for name in corpus.files], Path(scratch) / "out", validation_fraction=0.1)
        found: dict[str, list[float]] = {"in memory": [], "shards": []}
        for _ in range(rounds):
            for name, data in (("in memory", None), ("shards", f"{scratch}/out")):
                ends: list[float] = []
                config = TrainConfig(model="gpt", steps=steps, eval_every=0, eval_batches=1, data=data)
                train(config, on_step=lambda step, loss, ends=ends: ends.append(time.perf_counter()))
                found[name] += [b - a for a, b in itertools.pairwise(ends[1:])]
        comms.shutdown()
    for name, seconds in found.items():
        print(f"GPT step, batch read included, {name}: fastest {min(seconds) * 1e3:.1f} ms, median "
              f"{statistics.median(seconds) * 1e3:.1f} ms over {len(seconds)} steps")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("prepare")
    run.add_argument("megabytes", type=float)
    run.add_argument("--tokenizer", default="bytes")
    run.add_argument("--workers", type=int, default=2)
    commands.add_parser("batches")
    commands.add_parser("steps")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare_run(args.megabytes, args.tokenizer, args.workers)
    elif args.command == "batches":
        batches_run()
    else:
        steps_run()


if __name__ == "__main__":
    main()
