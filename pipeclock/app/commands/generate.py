"""``python -m pipeclock generate CKPT_DIR --prompt TEXT --tokens N``: text from a trained GPT.

The model's configuration is read from the checkpoint itself (``pipeclock.json``); the whole model is
loaded on one process, whatever the number of stages that trained it, and samples byte by byte.
"""

from __future__ import annotations

import argparse
import sys

from pipeclock.app import checkpoint, checkpoint_choice
from pipeclock.app.arguments import check_temperature, check_utf8, non_negative_float, non_negative_int
from pipeclock.models.registry import describe
from pipeclock.models.sampling import sample
from pipeclock.models.text import ByteTokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="a --checkpoint-dir of `train --model gpt`, or one step_NNNNNN")
    parser.add_argument("--prompt", default="def ", help="the text to continue (default: %(default)r)")
    parser.add_argument("--tokens", type=non_negative_int, default=200, help="bytes to generate")
    parser.add_argument(
        "--temperature", type=non_negative_float, default=0.8, help="0 takes the likeliest byte"
    )
    parser.add_argument(
        "--top-k", type=non_negative_int, default=0, help="sample among the k likeliest (0: all)"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="the sampling seed")


def run(args: argparse.Namespace) -> int:
    try:
        _check(args)
        path = checkpoint_choice.resolve(args.directory)
        model, run_info = checkpoint.load_model(path)
        if run_info.get("model") not in ("GPT", "HF"):
            raise ValueError(f"{path} holds a {describe(run_info)}, not a GPT: nothing to generate text with")
    except (ValueError, checkpoint.CheckpointError) as error:
        print(f"pipeclock generate: error: {error}", file=sys.stderr, flush=True)
        return 2
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode(args.prompt)
    seq_len = run_info["gpt"]["seq_len"] if run_info["model"] == "GPT" else run_info["seq_len"]
    ids = sample(model, prompt, args.tokens, seq_len, args.temperature, args.top_k, args.seed)
    print(f"# {describe(run_info)}, step {run_info['step']}, from {path}", file=sys.stderr, flush=True)
    print(tokenizer.decode(ids), flush=True)
    return 0


def _check(args: argparse.Namespace) -> None:
    if not args.prompt:
        raise ValueError("--prompt must hold at least one character")
    check_utf8(args.prompt, "--prompt")
    check_temperature(args.temperature)
