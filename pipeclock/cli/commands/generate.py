"""``[torchrun --nproc-per-node P -m] pipeclock generate CKPT_DIR --prompt TEXT --tokens N``: text from a
trained GPT or Hugging Face model, on one process or cut into P stages.

The model's configuration comes from the checkpoint (``pipeclock.json``). Each rank builds only its
stage's pieces and reads only their weights (``checkpoint.load_weights``), then runs its share of the
decode schedule (``generation.pipeline``): the prompts' prefill, then one byte per step, with a key/value
cache per prompt (a Hugging Face model's in transformers' ``DynamicCache``; ``--no-cache``: the whole
window every byte), on one intra-op thread per rank (a decode step computes one byte: more threads only
wait for each other, see ``docs/benchmarks.md``). Prompts travel in ``--groups`` groups so the pipeline
stays full. The last rank samples and prints as bytes come: one prompt's text byte by byte; several
prompts' line by line, each line prefixed ``[i]``.

Prompts are bytes: ``--prompt`` as the shell passed it (``os.fsencode``: invalid UTF-8 included), a
``--prompts`` file read in binary, one prompt per line (blank lines skipped). The model reads bytes, so
any byte sequence is a prompt; the output shows bytes that are not UTF-8 as U+FFFD.
"""

from __future__ import annotations

import argparse
import codecs
import os
import statistics
import sys
from pathlib import Path

import torch

from pipeclock import comms
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.cli import interrupts
from pipeclock.cli.arguments import (
    check_output,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from pipeclock.comm_errors import CommError
from pipeclock.generation.decode_program import simulate
from pipeclock.generation.pipeline import TIMED_TOKENS, Outcome, Settings, StageRunner, split_groups
from pipeclock.generation.stage_model import StageModel
from pipeclock.models.registry import describe, run_tokens
from pipeclock.models.sampling import sample
from pipeclock.observe.timeline import Timeline

DEFAULT_PROMPT = "def "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="a --checkpoint-dir of `train --model gpt`, or one step_NNNNNN")
    parser.add_argument(
        "--prompt",
        action="append",
        help=f"a text to continue; repeat for several (default: {DEFAULT_PROMPT!r})",
    )
    parser.add_argument("--prompts", metavar="FILE", help="more prompts, one per line (blank lines skipped)")
    parser.add_argument(
        "--tokens", type=non_negative_int, default=200,
        help="bytes to generate per prompt (fewer if the stop string comes); also --max-new-tokens",
    )  # fmt: skip
    parser.add_argument(
        "--max-new-tokens",
        dest="tokens",
        type=non_negative_int,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--temperature", type=non_negative_float, default=0.8, help="0 takes the likeliest byte"
    )
    parser.add_argument(
        "--top-k", type=non_negative_int, default=0, help="sample among the k likeliest (0: all)"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="the sampling seed")
    parser.add_argument("--stop", help="end a prompt's text once it ends with this string (kept)")
    parser.add_argument(
        "--groups", type=positive_int, default=None,
        help="groups of prompts that travel the pipeline one after another (default: one per rank, "
        "at most one per prompt)",
    )  # fmt: skip
    parser.add_argument(
        "--no-cache", action="store_true", help="no key/value cache: the whole window per byte"
    )
    parser.add_argument("--png", metavar="FILE", help="draw each rank's forwards, measured, to a PNG")
    parser.add_argument("--timeout", type=positive_float, default=60.0, help="seconds any wait may take")


def run(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0"))
    with interrupts.signals_caught():
        try:
            return _run(args)
        except KeyboardInterrupt as interrupt:
            return _interrupted(rank, interrupts.exit_code(interrupt))
        except (ValueError, checkpoint.CheckpointError, CommError) as error:
            if interrupts.received() is not None:  # a peer stopped first, before this rank's own signal
                return _interrupted(rank, 128 + interrupts.received())
            if rank == 0 or isinstance(error, CommError):  # the same error on every rank: said once
                print(f"pipeclock generate: error: {error}", file=sys.stderr, flush=True)
            return 1 if isinstance(error, CommError) else 2  # bad input, or a checkpoint not there: 2
        finally:
            comms.shutdown()


def _interrupted(rank: int, code: int) -> int:
    print(f"rank {rank}: interrupted", file=sys.stderr, flush=True)
    return code


def _run(args: argparse.Namespace) -> int:
    path = checkpoint_choice.resolve(args.directory)
    run_info = checkpoint_choice.read_run(path)
    _check_bytes(run_info)
    tokens = run_tokens(run_info)
    if tokens is not None:
        return _generate_in_tokens(args, path, run_info, tokens)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = StageModel.of(run_info, path, world)  # more ranks than pieces: one line, before any wait
    prompts = read_prompts(args, model.seq_len)
    groups = split_groups(len(prompts), args.groups or min(world, len(prompts)))
    if args.png:
        check_output(args.png, "--png")
    rank, world = comms.init(timeout=args.timeout)
    torch.set_num_threads(1)  # a decode step is a batch of one byte: more threads only wait for each other
    pieces = model.build(rank, world).to(comms.device())  # a GPU of its own under nccl
    checkpoint.load_weights(path, [pieces])
    settings = Settings(
        tokens=args.tokens, seq_len=model.seq_len, dim=model.dim, temperature=args.temperature,
        top_k=args.top_k, seed=args.seed, stop=os.fsencode(args.stop or ""), cache=not args.no_cache,
    )  # fmt: skip
    last = rank == world - 1
    if last:
        print(f"# {describe(run_info)}, step {run_info['step']}, from {path}", file=sys.stderr, flush=True)
    printer = Printer(prompts) if last else None
    comms.barrier("starting to generate")
    runner = StageRunner(pieces, prompts, groups, settings, model.decoding)
    outcome = runner.run(printer.byte if printer else None)
    if printer:
        printer.close()
    _report(outcome, args, world, groups, settings)
    return 0


def _check_bytes(run_info: dict) -> None:
    """A GPT trained on a token folder of another tokenizer's ids would be read as bytes: refused."""
    kind = run_info.get("tokens")
    if run_info.get("model") == "GPT" and kind not in (None, "bytes"):
        raise ValueError(
            f"this GPT was trained on {kind} tokens, and generate writes a GPT's text as bytes: train it on "
            "bytes (prepare --tokenizer bytes), or train a Hugging Face model (--model hf) on those tokens"
        )


def _generate_in_tokens(args: argparse.Namespace, path, run_info: dict, tokens) -> int:
    """A Hugging Face checkpoint trained in its tokenizer's tokens: the whole model on one process,
    without a cache, prompt after prompt, ``--tokens`` tokens each, decoded by that tokenizer."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "a checkpoint trained in a tokenizer's tokens generates on one process: run generate without "
            "torchrun (byte-level checkpoints generate across stages)"
        )
    model = checkpoint.load_model(path)[0]
    seq_len = run_info["seq_len"]
    print(f"# {describe(run_info)}, step {run_info['step']}, from {path}", file=sys.stderr, flush=True)
    for index, prompt in enumerate(read_prompts(args, seq_len)):
        ids = sample(model, torch.tensor(_as_tokens(tokens, prompt, seq_len)), args.tokens, seq_len,
                     args.temperature, args.top_k, args.seed, prompt_index=index, cache=False)  # fmt: skip
        text = tokens.decode(ids.tolist())
        print(text if index == 0 and not args.prompts and len(args.prompt or []) < 2 else f"[{index}] {text}")
    return 0


def _as_tokens(tokens, prompt: list[int], seq_len: int) -> list[int]:
    """A prompt's bytes as the run's tokens (bad UTF-8 as U+FFFD); it must fit the context too."""
    ids = tokens.encode(bytes(prompt).decode("utf-8", errors="replace"))
    if not ids or len(ids) > seq_len:
        raise ValueError(f"a prompt is {len(ids)} tokens: the model's context holds 1 to {seq_len}")
    return ids


def read_prompts(args: argparse.Namespace, seq_len: int) -> list[list[int]]:
    """The prompts as byte ids: ``--prompt`` ones, then the ``--prompts`` file's lines; each must be one
    byte at least and fit the context with room for one more."""
    given = [os.fsencode(text) for text in args.prompt or []]
    if args.prompts:
        try:
            lines = [line for line in Path(args.prompts).read_bytes().splitlines() if line]
        except OSError as error:
            raise ValueError(f"--prompts {args.prompts}: {error.strerror or error}") from None
        if not lines:
            raise ValueError(f"--prompts {args.prompts} holds no prompt (one per line, blank lines skipped)")
        given += lines
    elif not given:
        given = [DEFAULT_PROMPT.encode()]
    for index, prompt in enumerate(given):
        where = "" if len(given) == 1 else f" {index}"
        if not prompt:
            raise ValueError(f"--prompt{where} must hold at least one character")
        if len(prompt) > seq_len:
            raise ValueError(
                f"prompt{where} is {len(prompt)} bytes, longer than the model's context of {seq_len} bytes"
            )
    return [list(prompt) for prompt in given]


class Printer:
    """The last rank's output: one prompt's text byte by byte as it comes; several prompts' line by
    line, ``[i] `` before each line. Bytes that are not UTF-8 are shown as U+FFFD."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.several = len(prompts) > 1
        self.decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in prompts]
        self.lines = [self.decoders[i].decode(bytes(prompt)) for i, prompt in enumerate(prompts)]
        if not self.several:
            self._write(self.lines[0])

    def byte(self, index: int, byte: int) -> None:
        text = self.decoders[index].decode(bytes([byte]))
        if not self.several:
            self._write(text)
            return
        self.lines[index] += text
        *complete, self.lines[index] = self.lines[index].split("\n")
        for line in complete:
            self._write(f"[{index}] {line}\n")

    def close(self) -> None:
        for index, decoder in enumerate(self.decoders):
            rest = (
                self.lines[index] + decoder.decode(b"", final=True)
                if self.several
                else decoder.decode(b"", final=True)
            )
            self._write(f"[{index}] {rest}\n" if self.several else rest + "\n")

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def _report(
    outcome: Outcome, args: argparse.Namespace, world: int, groups: list[list[int]], settings: Settings
) -> None:
    """The figures on stderr (the last rank's), and ``--png``'s timeline of every rank (drawn on rank 0)."""
    every = comms.gather_object(outcome, "gathering the timelines", dst=0)
    if every is None:
        return
    last = every[-1]
    made = sum(len(text) for text in last.texts.values())
    first = min(last.first_byte_s.values(), default=0.0)
    after = made - sum(len(group) for group in groups)
    rate = after / (last.seconds - first) if last.seconds > first and after > 0 else 0.0
    print(
        f"# {made} bytes from {_count(len(last.texts), 'prompt')} on {_count(world, 'rank')}, "
        f"{_count(len(groups), 'group')}, "
        f"{'with' if settings.cache else 'without'} the cache: first byte after {first:.3f} s, "
        f"then {rate:.1f} bytes/s",
        file=sys.stderr,
        flush=True,
    )
    held = ", ".join(f"{o.weight_bytes / 2**20:.2f} + {o.cache_bytes / 2**20:.2f}" for o in every)
    print(f"# MiB per rank, weights + key/value caches: {held}", file=sys.stderr, flush=True)
    measured, predicted = timelines(every, world, groups, settings.tokens)
    print(
        f"# decode bubble: measured {measured.bubble_share:.1%}, simulator {predicted.bubble_share:.1%} "
        "(every prompt's forward costing the measured median)",
        file=sys.stderr,
        flush=True,
    )
    if args.png:
        from pipeclock.observe.diagrams import draw_comparison_png

        title = f"generate, {world} ranks, {len(groups)} groups"
        panels = [(f"{title}, measured", measured), (f"{title}, simulator", predicted)]
        path = draw_comparison_png(panels, args.png, unit="s")
        print(f"# timeline drawn to {path}", file=sys.stderr, flush=True)


def timelines(
    every: list[Outcome], world: int, groups: list[list[int]], tokens: int
) -> tuple[Timeline, Timeline]:
    """The measured timeline of every rank, and the engine's simulator's for the same decode program, in
    seconds: of the first ``TIMED_TOKENS`` tokens, those the spans keep."""
    measured = Timeline([span for outcome in every for span in outcome.spans], world)
    sizes = [len(group) for group in groups]
    per_prompt = (
        statistics.median(s.compute / sizes[s.action.microbatch] for s in measured.spans)
        if measured.spans
        else 0.0
    )
    predicted = simulate(world, sizes, min(tokens, TIMED_TOKENS), per_prompt)
    return measured, predicted


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
