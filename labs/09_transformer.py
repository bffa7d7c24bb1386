"""Lab 9: a transformer across stages.

The pipeline does not care what a stage computes, so the last lab cuts a real model: a small GPT of
byte tokens. Its pieces are the token embedding, the transformer blocks and the head, and a stage is a
run of consecutive pieces. Three things are new compared with the MLP of labs 4 to 8.

The ends are different. The first stage holds the embedding (vocab x dim numbers) and the last the head,
which in GPT-2 is the same matrix. With 256 byte tokens that matrix is small; with GPT-2's 50,257 tokens
it is larger than many blocks together, so the first and last stages are the heavy ones.

The matrix is tied. On one device the embedding and the head use one tensor, whose gradient adds both
uses. Cut in two, each end holds a copy; the pipeline sums the copies' gradients after the backward, so
both take the same step and stay equal, and the update is the one-device update.

A message is a pytree. Stage 0 hands stage 1 a tuple: the hidden states, whose gradient comes back, and
the int64 token positions the rotary embedding needs, which have no gradient and travel forward only.

Then the lab trains for a few seconds and writes text before and after, from the same prompt.

Run it:  torchrun --nproc-per-node 2 labs/09_transformer.py        (or: python -m pipeclock lab 9)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from pipeclock import comms, model, schedule
from pipeclock.cli.interrupts import run_as_script
from pipeclock.engine.pytree import carries_gradient, describe, leaves
from pipeclock.engine.ties import tie_key
from pipeclock.models.gpt import TIED_KEY
from pipeclock.models.sampling import sample
from pipeclock.models.text import ByteTokenizer, TextCorpus, bigram_bits_per_byte, bits_per_byte

PROCESSES = 2  # how many processes `python -m pipeclock lab 9` asks torchrun for
GPT2_VOCAB = 50_257
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 9: a GPT cut into pipeline stages")
    parser.add_argument("--dim", type=int, default=64, help="width of the hidden states")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--microbatches", "-m", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--prompt", default="def ", help="the text both samples start from")
    parser.add_argument("--tokens", type=int, default=60, help="bytes to generate after the prompt")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def config_of(args: argparse.Namespace) -> model.GPTConfig:
    return model.GPTConfig(
        dim=args.dim, layers=args.layers, heads=args.heads, seq_len=args.seq_len, seed=args.seed
    )


# --- 1. what each stage holds -------------------------------------------------------------------------


def holdings(chunk: nn.Sequential) -> tuple[list[str], int]:
    return [name for name, _ in chunk.named_children()], sum(p.numel() for p in chunk.parameters())


def show_stages(gathered: list[tuple[list[str], int]], config: model.GPTConfig) -> None:
    print("1. what each stage holds")
    for rank, (pieces, count) in enumerate(gathered):
        print(f"  rank {rank}: {' '.join(pieces):<14} {count:>9,} parameters  {count * 4 / MIB:.2f} MiB")
    one_device = model.gpt_sequential(config)
    whole = sum(p.numel() for p in one_device.parameters())
    matrix = config.vocab_size * config.dim
    block = sum(p.numel() for p in one_device.h0.parameters())
    big = GPT2_VOCAB * config.dim
    print(
        f"  one device: {whole:,} parameters; the ranks hold {sum(c for _, c in gathered):,}, "
        f"the tied matrix once more"
    )
    print(
        f"  the embedding and the head: vocab x dim = {config.vocab_size} x {config.dim} = {matrix:,} "
        f"numbers each; a block holds {block:,}"
    )
    print(
        f"  with GPT-2's vocabulary: {GPT2_VOCAB:,} x {config.dim} = {big:,} numbers "
        f"({big * 4 / MIB:.1f} MiB), {big / block:.0f} blocks' worth, on the first stage and again on "
        "the last\n"
    )


# --- 2. the message between stages ----------------------------------------------------------------------


def show_message(chunk: nn.Sequential, ids: torch.Tensor, m: int) -> None:
    with torch.no_grad():
        message = chunk(schedule.split_microbatches(ids, m)[0])
    kinds = ", ".join(
        f"{describe(leaf)} {'forward, its gradient back' if carries_gradient(leaf) else 'forward only'}"
        for leaf in leaves(message)
    )
    print("2. what stage 0 hands stage 1, per micro-batch")
    print(f"  {describe(message)}")
    print(f"  {kinds}\n")


# --- 3. the tie -------------------------------------------------------------------------------------------


def tied_copies(chunk: nn.Sequential) -> list[nn.Parameter]:
    found = []
    for parameter in chunk.parameters():
        if tie_key(parameter) == TIED_KEY and all(parameter is not p for p in found):
            found.append(parameter)
    return found


def one_device_gradients(config: model.GPTConfig, ids, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """The tied matrix's gradient on one device, and the head's share of it (an untied copy's)."""
    loss_fn = schedule.TokenCrossEntropy()
    reference = model.gpt_sequential(config)
    loss_fn.mean(reference(ids), targets).backward()
    untied = model.gpt_sequential(config)
    untied.head.lm_head.weight = nn.Parameter(untied.embed.wte.weight.detach().clone())
    loss_fn.mean(untied(ids), targets).backward()
    return reference.embed.wte.weight.grad, untied.head.lm_head.weight.grad


def show_tie(copies_grads, copies_after, reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    whole, head_part = reference
    embed_part = whole - head_part
    grads = [g for per_rank in copies_grads for g in per_rank]
    weights = [w for per_rank in copies_after for w in per_rank]
    holders = [r for r, per_rank in enumerate(copies_grads) if per_rank]
    grad_gap = max((g - grads[0]).abs().max().item() for g in grads)
    weight_gap = max((w - weights[0]).abs().max().item() for w in weights)
    relative = (grads[0] - whole).abs().max().item() / whole.abs().max().item()
    print(f"3. the tie: {TIED_KEY} has a copy on ranks {', '.join(map(str, holders))}")
    print(
        f"  one device, the two uses' shares of its gradient: embedding norm {embed_part.norm():.3g}, "
        f"head norm {head_part.norm():.3g}"
    )
    print(f"  after one step, the copies' gradients: max difference {grad_gap:.3g} (each holds the sum)")
    print(f"  against the one-device gradient: max relative gap {relative:.1e}")
    print(f"  after the optimizer step, the copies' weights: max difference {weight_gap:.3g}\n")


# --- 4. training, and text --------------------------------------------------------------------------------


def whole_model(states: list[dict], config: model.GPTConfig) -> nn.Module:
    """The one-device model with every stage's trained weights."""
    merged = {key: value for state in states for key, value in state.items()}
    gathered = model.gpt_sequential(config)
    gathered.load_state_dict(merged)
    return gathered


def write(net: nn.Module, args: argparse.Namespace) -> str:
    tokenizer = ByteTokenizer()
    ids = sample(net, tokenizer.encode(args.prompt), args.tokens, args.seq_len, 0.8, 0, args.seed)
    text = tokenizer.decode(ids)
    return "".join(c if c == "\n" or (c.isascii() and c.isprintable()) else "?" for c in text)


def validation_bits(pipe: schedule.Pipeline, batches) -> float:
    losses = [pipe.evaluate(inputs, targets) for inputs, targets in batches]
    return bits_per_byte(sum(losses) / len(losses))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    torch.manual_seed(args.seed)
    config = config_of(args)
    chunk = model.GPT.for_rank(config, rank, world)[0]
    corpus = TextCorpus.default()
    validation = corpus.validation_batches(args.batch_size, args.seq_len, max_batches=4)
    if rank == 0:
        print(
            f"a GPT of {args.layers} blocks, dim {args.dim}, {args.heads} heads, "
            f"{args.seq_len}-byte sequences, on {world} stages; 1F1B, m = {args.microbatches}\n"
            f"{corpus.summary()}\n"
        )
    gathered = comms.gather_object(holdings(chunk), "gathering what each stage holds")
    if rank == 0:
        show_stages(gathered, config)

    ids, targets = corpus.batch(0, args.batch_size, args.seq_len, seed=args.seed)
    if rank == 0 and world > 1:
        show_message(chunk, ids, args.microbatches)

    pipe = schedule.Pipeline([chunk], "1f1b", args.microbatches, schedule.TokenCrossEntropy())
    optimizer = torch.optim.AdamW(chunk.parameters(), lr=args.lr)
    before = validation_bits(pipe, validation)
    copies = tied_copies(chunk)
    first_loss = pipe.step(ids, targets)
    grads = comms.gather_object([c.grad.clone() for c in copies], "gathering the tied gradients")
    optimizer.step()
    optimizer.zero_grad()
    weights = comms.gather_object([c.detach().clone() for c in copies], "gathering the tied weights")
    if rank == 0:
        show_tie(grads, weights, one_device_gradients(config, ids, targets))
        print("4. training, and text")
        untrained = write(model.gpt_sequential(config), args)
        print(f"  before training: {untrained!r}")
        print(f"  step 1 loss {first_loss:.3f}", flush=True)

    for step in range(1, args.steps):
        loss = pipe.step(*corpus.batch(step, args.batch_size, args.seq_len, seed=args.seed))
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step + 1) % 50 == 0:
            print(f"  step {step + 1} loss {loss:.3f}", flush=True)
    after = validation_bits(pipe, validation)
    states = comms.gather_object(chunk.state_dict(), "gathering the trained stages")
    if rank == 0:
        print(f"  after training:  {write(whole_model(states, config), args)!r}")
        bigram = bigram_bits_per_byte(corpus, validation)
        print(
            f"  validation bits per byte: {before:.2f} before, {after:.2f} after; "
            f"a bigram model {bigram:.2f}, uniform bytes 8"
        )
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
