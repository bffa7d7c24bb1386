"""``python -m pipeclock export DIR OUT.pt``: the whole model from a checkpoint, as one plain state_dict.

A checkpoint is spread over one file per stage; inference wants one model in one process. Export reads
every layer of the newest complete checkpoint in DIR (no process group needed) and saves a ``state_dict``
that loads into the whole model (``ShardedMLP(hidden, layers)``, or for a GPT
``gpt_sequential(GPTConfig(...))`` with the configuration the command prints)::

    model = ShardedMLP(hidden, layers)
    model.load_state_dict(torch.load("OUT.pt"))
"""

from __future__ import annotations

import argparse
import sys

import torch

from pipeclock.app import checkpoint
from pipeclock.models.registry import describe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory", help="a --checkpoint-dir of train (its newest complete checkpoint), or one step_NNNNNN"
    )
    parser.add_argument("output", help="the file to write the state_dict to (torch.save)")


def run(args: argparse.Namespace) -> int:
    try:
        path = checkpoint.resolve(args.directory)
        state, run_info = checkpoint.load_full_model(path)
    except checkpoint.CheckpointError as error:
        print(f"pipeclock export: error: {error}", file=sys.stderr, flush=True)
        return 2
    torch.save(state, args.output)
    print(
        f"exported {path} (step {run_info['step']}, {describe(run_info)}) to {args.output}: {_how(run_info)}"
    )
    return 0


def _how(run_info: dict) -> str:
    if run_info.get("model") == "GPT":
        arguments = ", ".join(f"{key}={value!r}" for key, value in run_info["gpt"].items())
        return f"load it into gpt_sequential(GPTConfig({arguments}))"
    return f"load it into ShardedMLP({run_info['hidden']}, {run_info['layers']})"
