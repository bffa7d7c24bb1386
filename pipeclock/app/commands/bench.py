"""``pipeclock bench``: pipeclock against torch.distributed.pipelining and one process.

python -m pipeclock bench            # the full sweep, the same as ``python -m benchmarks.run``
python -m pipeclock bench --quick    # a smaller one

The benchmarks live beside the package, in the repository's ``benchmarks/``; this command only finds
them and hands over its arguments.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[3]


def _benchmarks_run():
    if not (REPOSITORY / "benchmarks" / "run.py").is_file():
        raise SystemExit(f"pipeclock bench: no benchmarks/ beside the package (looked in {REPOSITORY})")
    if str(REPOSITORY) not in sys.path:
        sys.path.insert(0, str(REPOSITORY))
    return importlib.import_module("benchmarks.run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _benchmarks_run().add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    args.command_line = shlex.join(["python", "-m", "pipeclock", *sys.argv[1:]])
    return _benchmarks_run().run(args)
