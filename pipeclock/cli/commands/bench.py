"""``pipeclock bench``: pipeclock against torch.distributed.pipelining and one process.

python -m pipeclock bench            # the full sweep, the same as ``python -m benchmarks.run``
python -m pipeclock bench --quick    # a smaller one

The benchmarks live beside the package, in the repository's ``benchmarks/``; this command only finds
them and hands over its arguments (an installed package without its checkout says so in one line).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from pipeclock.cli.checkout import import_from_checkout


def _benchmarks_run():
    return import_from_checkout("benchmarks.run", "bench")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _benchmarks_run().add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    args.command_line = shlex.join(["python", "-m", "pipeclock", *sys.argv[1:]])
    return _benchmarks_run().run(args)
