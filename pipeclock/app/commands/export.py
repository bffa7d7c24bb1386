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
    parser.add_argument("output", nargs="?", help="the file to write the state_dict to (torch.save)")
    parser.add_argument(
        "--hf", metavar="OUT",
        help="a Hugging Face model's checkpoint (train --model hf): write a save_pretrained directory OUT "
        "that AutoModelForCausalLM.from_pretrained(OUT) loads",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if (args.output is None) == (args.hf is None):
        print("pipeclock export: error: give one of OUTPUT (a state_dict file) or --hf OUT", file=sys.stderr)
        return 2
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
    if args.hf:
        return _export_hf(state, run_info, path, args.hf)
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


def _export_hf(state: dict, run_info: dict, path, output: str) -> int:
    if run_info.get("model") != "HF":
        print(
            f"pipeclock export: error: {path} holds {describe(run_info)}, not a Hugging Face model",
            file=sys.stderr,
        )
        return 2
    from pipeclock.models.hf.export import save_pretrained
    from pipeclock.models.registry import hf_config

    save_pretrained(state, hf_config(run_info), output)
    print(
        f"exported {path} (step {run_info['step']}, {describe(run_info)}) to {output}: "
        f"AutoModelForCausalLM.from_pretrained({output!r}) loads it"
    )
    return 0
