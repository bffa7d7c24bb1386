"""``python -m pipeclock export DIR OUT.pt``: the whole model from a checkpoint, as one plain state_dict.

A checkpoint is spread over one file per stage; inference wants one model in one process. Export reads
every layer of the newest sound checkpoint in DIR, or of the one checkpoint DIR names (no process group
needed), and saves a ``state_dict`` that loads into the whole model (``ShardedMLP(hidden, layers)``, or
for a GPT ``gpt_sequential(GPTConfig(...))`` with the configuration the command prints)::

    model = ShardedMLP(hidden, layers)
    model.load_state_dict(torch.load("OUT.pt"))

The checkpoint is checked whole first (``pipeclock.checkpoints.integrity``): a damaged file is one
error naming it, or, when DIR is a run directory, a line saying which newer checkpoint was passed over.
OUT is checked before anything is read: it must be writable (a probe file is written there), and an
existing OUT is refused unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.cli.arguments import check_output
from pipeclock.models.registry import describe
from pipeclock.observe.sizes import format_bytes


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
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUTPUT (or --hf's OUT) if it exists (else an existing one is refused)",
    )


def run(args: argparse.Namespace) -> int:
    if (args.output is None) == (args.hf is None):
        print("pipeclock export: error: give one of OUTPUT (a state_dict file) or --hf OUT", file=sys.stderr)
        return 2
    try:
        _check_output(args.output or args.hf, args.overwrite, "OUTPUT" if args.output else "--hf")
        choice = checkpoint_choice.choose(args.directory, together=False)
        if choice.path is None:
            checkpoint_choice.resolve(args.directory)  # the error saying why there is none
        for line in choice.skipped_lines("exporting"):
            print(f"pipeclock export: {line}", file=sys.stderr, flush=True)
        path = choice.path
        state, run_info = checkpoint.load_full_model(path)
    except (checkpoint.CheckpointError, ValueError) as error:
        print(f"pipeclock export: error: {error}", file=sys.stderr, flush=True)
        return 2
    if args.hf:
        return _export_hf(state, run_info, path, args.hf)
    try:
        with _written_whole(args.output, state) as partial:
            torch.save(state, partial)
    except WriteFailed as error:
        print(f"pipeclock export: error: {error}", file=sys.stderr)
        return 1
    print(
        f"exported {path} (step {run_info['step']}, {describe(run_info)}) to {args.output}: {_how(run_info)}"
    )
    return 0


def _check_output(output: str, overwrite: bool, option: str) -> None:
    """Before the checkpoint is read: the target can be written (a probe, ``check_output``), and it does
    not exist, unless ``--overwrite`` says to replace it."""
    if option == "--hf":
        check_output(output, option, folder=True)
        if Path(output).exists() and not overwrite:
            raise ValueError(f"--hf {output} exists; pass --overwrite to replace it, or name another folder")
        return
    check_output(output, option)
    if Path(output).is_file() and not overwrite:
        raise ValueError(f"OUTPUT {output} exists; pass --overwrite to replace it, or name another file")


def _how(run_info: dict) -> str:
    if run_info.get("model") == "GPT":
        arguments = ", ".join(f"{key}={value!r}" for key, value in run_info["gpt"].items())
        return f"load it into gpt_sequential(GPTConfig({arguments}))"
    return f"load it into ShardedMLP({run_info['hidden']}, {run_info['layers']})"


class WriteFailed(OSError):
    """Writing the export failed (a full disk, most often); nothing was left at its path."""


@contextmanager
def _written_whole(output: str, state: dict) -> Iterator[Path]:
    """A path beside ``output`` to write to, renamed to ``output`` once the block has written it all:
    a failed write (a disk that filled up) leaves no truncated file, and what ``--overwrite`` would have
    replaced stays whole. A failure is a ``WriteFailed`` saying why: on a full disk, the free space
    against the model's size."""
    target = Path(output)
    partial, free = target.with_name(f".{target.name}.partial"), None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove(partial)
        free = shutil.disk_usage(target.parent).free
        yield partial
        if target.is_dir():  # --hf --overwrite: the old folder goes once the new one is whole
            shutil.rmtree(target)
        os.replace(partial, target)
    except (OSError, RuntimeError) as error:  # torch reports a short write in a RuntimeError
        _remove(partial)
        why = _why(error, free, state)
        raise WriteFailed(f"writing {output} failed: {why}; nothing was written") from None


def _why(error: BaseException, free: int | None, state: dict) -> str:
    """A full disk said as one (``free`` is what it had before the write), else the error's first line."""
    needed = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    if free is not None and (getattr(error, "errno", None) == errno.ENOSPC or free < needed):
        return f"its disk is full (it had {format_bytes(free)} free, the model needs {format_bytes(needed)})"
    return _first_line(error)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _export_hf(state: dict, run_info: dict, path, output: str) -> int:
    if run_info.get("model") != "HF":
        print(
            f"pipeclock export: error: {path} holds {describe(run_info)}, not a Hugging Face model "
            "(export it without --hf: export CKPT FILE.pt)",
            file=sys.stderr,
        )
        return 2
    from pipeclock.models.hf.export import save_pretrained
    from pipeclock.models.registry import hf_config, run_tokens

    try:
        tokens = run_tokens(run_info)
    except ValueError as error:
        print(f"pipeclock export: error: {error}", file=sys.stderr)
        return 2
    try:
        trusted = bool(run_info.get("trust_remote_code"))
        with _written_whole(output, state) as partial:
            save_pretrained(state, hf_config(run_info), partial, trust_remote_code=trusted)
            if tokens is not None:
                tokens.save(partial)
    except WriteFailed as error:
        print(f"pipeclock export: error: {error}", file=sys.stderr)
        return 1
    tokenizer = f", and AutoTokenizer its tokenizer ({tokens.name})" if tokens is not None else ""
    print(
        f"exported {path} (step {run_info['step']}, {describe(run_info)}) to {output}: "
        f"AutoModelForCausalLM.from_pretrained({output!r}) loads it{tokenizer}"
    )
    return 0
