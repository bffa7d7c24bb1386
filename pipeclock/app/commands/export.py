"""``python -m pipeclock export DIR OUT.pt``: the whole model from a checkpoint, as one plain state_dict.

A checkpoint is spread over one file per stage; inference wants one model in one process. Export reads
every layer of the newest sound checkpoint in DIR, or of the one checkpoint DIR names (no process group
needed), and saves a ``state_dict`` that loads into the whole model (``ShardedMLP(hidden, layers)``, or
for a GPT ``gpt_sequential(GPTConfig(...))`` with the configuration the command prints)::

    model = ShardedMLP(hidden, layers)
    model.load_state_dict(torch.load("OUT.pt"))

The checkpoint is checked whole first (``pipeclock.app.checkpoint_integrity``): a damaged file is one
error naming it, or, when DIR is a run directory, a line saying which newer checkpoint was passed over.
"""

from __future__ import annotations

import argparse
import sys

import torch

from pipeclock.app import checkpoint, checkpoint_choice
from pipeclock.models.registry import describe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory",
        help="a --checkpoint-dir of train (its newest sound checkpoint: damaged newer ones are skipped, "
        "and named), or one step_NNNNNN (an error if it is damaged)",
    )
    parser.add_argument("output", help="the file to write the state_dict to (torch.save)")


def run(args: argparse.Namespace) -> int:
    try:
        choice = checkpoint_choice.choose(args.directory, together=False)
        if choice.path is None:
            checkpoint_choice.resolve(args.directory)  # the error saying why there is none
        for line in choice.skipped_lines("exporting"):
            print(f"pipeclock export: {line}", file=sys.stderr, flush=True)
        path = choice.path
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
