"""The command line: ``python -m pipeclock <command> ...`` (and ``torchrun ... -m pipeclock train ...``).

Each command lives in ``pipeclock/cli/commands/<name>.py`` with ``add_arguments(parser)`` and ``run(args)``
(and, if it has more to say than its line below, a ``DESCRIPTION`` for its ``--help``); it is imported
only when chosen, so ``pipeclock schedule`` starts without touching torch.distributed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from pipeclock.cli.arguments import DefaultsHelpFormatter, Parser
from pipeclock.cli.interrupts import exit_code, signals_caught
from pipeclock.engine.notices import RunWarning

COMMANDS: dict[str, str] = {
    "train": "train a ShardedMLP or a GPT with pipeline parallelism (the main job; launch with torchrun)",
    "schedule": "draw or simulate a schedule, no processes needed",
    "explore": "a page to play with the schedules in a browser: timelines, bubble, memory, side by side",
    "lab": "run one of the course's labs (launches torchrun itself where the lab needs processes)",
    "bench": "compare pipeclock with torch.distributed.pipelining and one process",
    "export": "write one plain state_dict for the whole model from a checkpoint",
    "generate": "text from a checkpoint of train --model gpt, on one process or across stages",
    "prepare": "tokenize documents (text, .jsonl, .parquet) into token shards for train --data DIR",
    "plan": "will a model fit: memory per rank and step time for each schedule, stages, micro-batches",
    "docs": "regenerate the course's figures and outputs",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command listed, only the chosen one's options built (and imported)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="pipeclock",
        description="Pipeline-parallel training for PyTorch, and the course that teaches it.",
        formatter_class=DefaultsHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    chosen = argv[0] if argv else None
    for name, help_text in COMMANDS.items():
        module = _command_module(name) if name == chosen else None
        description = getattr(module, "DESCRIPTION", help_text)
        sub = commands.add_parser(name, help=help_text, description=description)
        sub.strict = True
        if module is not None:
            module.add_arguments(sub)
    return parser


def _command_module(name: str):
    return importlib.import_module(f"pipeclock.cli.commands.{name}")


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. A closed output pipe ends it quietly, Ctrl-C with one line."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    argv = sys.argv[1:]
    prog = " ".join(["pipeclock", *argv[:1]]) if argv and argv[0] in COMMANDS else "pipeclock"
    with signals_caught(), _run_warnings_as_lines(prog):
        try:
            args = build_parser(argv).parse_args(argv)
            code = int(_command_module(args.command).run(args) or 0)
            sys.stdout.flush()  # here, where a closed pipe is caught, rather than at the interpreter's exit
            return code
        except SystemExit as done:  # --help shown, a bad command line reported, or a command's own exit
            return _exit_code(done)
        except BrokenPipeError:  # `pipeclock schedule ... | head` closed our output: nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except KeyboardInterrupt as interrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return exit_code(interrupt)


@contextmanager
def _run_warnings_as_lines(prog: str) -> Iterator[None]:
    """Within the block, a ``RunWarning`` (the same on every rank) is one line, once, from rank 0 alone."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, RunWarning):
            shown(message, category, filename, lineno, file, line)
        elif os.environ.get("RANK", "0") == "0":
            print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("once", RunWarning)
        warnings.showwarning = show
        yield


def _exit_code(done: SystemExit) -> int:
    """What ``sys.exit`` would make of ``done``, returned instead: ``main`` can be called in-process;
    but a command's exit with a message (no lab 99, no checkout) is a refusal, so 2, not Python's 1."""
    if isinstance(done.code, str):
        print(done.code, file=sys.stderr)
        return 2
    return int(done.code or 0)
