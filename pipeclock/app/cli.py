"""The command line: ``python -m pipeclock <command> ...`` (and ``torchrun ... -m pipeclock train ...``).

Each command lives in ``pipeclock/app/commands/<name>.py`` with ``add_arguments(parser)`` and ``run(args)``;
it is imported only when chosen, so ``pipeclock schedule`` starts without touching torch.distributed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, str] = {
    "train": "train a ShardedMLP or a GPT with pipeline parallelism (the main job; launch with torchrun)",
    "schedule": "draw or simulate a schedule, no processes needed",
    "lab": "run one of the course's labs (launches torchrun itself where the lab needs processes)",
    "bench": "compare pipeclock with torch.distributed.pipelining and one process",
    "export": "write one plain state_dict for the whole model from a checkpoint",
    "generate": "sample text on one process from a checkpoint of train --model gpt",
    "plan": "will a model fit: memory per rank and step time for each schedule, stages, micro-batches",
    "docs": "regenerate the course's figures and outputs",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeclock",
        description="Pipeline-parallel training for PyTorch, and the course that teaches it.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = sys.argv[1] if len(sys.argv) > 1 else None
    for name, help_text in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            _command_module(name).add_arguments(sub)
    return parser


def _command_module(name: str):
    return importlib.import_module(f"pipeclock.app.commands.{name}")


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = build_parser().parse_args(sys.argv[1:])
    try:
        return int(_command_module(args.command).run(args) or 0)
    except BrokenPipeError:  # `pipeclock schedule ... | head` closed our output: nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"pipeclock {args.command}: interrupted", file=sys.stderr)
        return 130
