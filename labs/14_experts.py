"""Lab 14: experts across ranks, what expert parallel moves and what it saves, in one process.

A mixture of experts replaces a layer's MLP by many (the experts) and a router that sends each token to
a few of them (its top k). Expert parallel divides the experts of every MoE layer over ep ranks (carved
from the data-parallel replicas of a stage): each rank keeps only its own experts, and the tokens travel
to the rank holding their expert and back, by two all-to-alls a forward (dispatch, combine) and two a
backward. The lab computes, in one process, on a Qwen3-MoE layer of `transformers` (its own router):

1. which rank each token's experts live on, with ep 2 (each rank holding one replica's tokens);
2. the all-to-all's bytes, rank to rank, each way;
3. the memory of the experts per rank, with and without ep, for this layer and for DeepSeek-V3 (the
   cluster planner's figure);
4. what DualPipeV overlaps: one micro-batch's all-to-all under another's compute, in the simulator.

Run it:  python labs/14_experts.py        (or: python -m pipeclock lab 14)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pipeclock.cli.interrupts import run_as_script

HIDDEN, FFN, EXPERTS, TOP_K = 64, 128, 8, 2
CLUSTER = Path("docs") / "cluster"  # the planner's model configs and GPU datasheets, from the repository root
GIB, KIB = 2**30, 2**10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 14: experts across ranks")
    parser.add_argument("--ep", type=int, default=2, help="ranks the experts are divided over (default 2)")
    parser.add_argument("--tokens", type=int, default=6, help="tokens on each rank (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def moe_block(seed: int):
    """A Qwen3-MoE layer's MoE block, as `transformers` builds it, its weights drawn from ``seed``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=FFN, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=True)  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return block


def routing(args: argparse.Namespace, block) -> torch.Tensor:
    """Part 1: each token's experts by the layer's own router, and the rank holding each."""
    per_rank = EXPERTS // args.ep
    tokens = torch.randn(
        args.ep * args.tokens, HIDDEN, generator=torch.Generator().manual_seed(args.seed + 1)
    )
    with torch.no_grad():
        _, weights, chosen = block.gate(tokens)
    print(f"1. which rank each token's experts live on: {EXPERTS} experts, top {TOP_K}, ep {args.ep} "
          f"(rank r holds experts {per_rank}r to {per_rank}r+{per_rank - 1})\n")  # fmt: skip
    print("  rank  token  its experts (weight)          on ranks")
    for token in range(len(tokens)):
        experts = ", ".join(f"{e} ({w:.2f})" for e, w in zip(chosen[token].tolist(), weights[token].tolist(),
                                                              strict=True))  # fmt: skip
        ranks = ", ".join(str(e // per_rank) for e in chosen[token].tolist())
        print(f"  {token // args.tokens:<4}  {token:<5}  {experts:<28}  {ranks}")
    return chosen


def exchange(args: argparse.Namespace, chosen: torch.Tensor) -> None:
    """Part 2: the copies each rank sends each other rank, and their bytes, each way."""
    per_rank = EXPERTS // args.ep
    copies = torch.zeros(args.ep, args.ep, dtype=torch.long)
    for token, experts in enumerate(chosen.tolist()):
        for expert in experts:
            copies[token // args.tokens, expert // per_rank] += 1
    row_bytes = HIDDEN * 4  # one token's hidden state, fp32
    print(
        f"\n2. the all-to-all's bytes: a copy is one token's hidden state, {HIDDEN} x 4 B = {row_bytes} B\n"
    )
    print(
        "  dispatch (forward: tokens to their experts), copies and bytes, from rank (row) to rank (column):"
    )
    for source in range(args.ep):
        cells = "  ".join(f"{int(copies[source, d]):>2} = {int(copies[source, d]) * row_bytes:>5} B"
                          for d in range(args.ep))  # fmt: skip
        print(f"    rank {source}:  {cells}")
    away = int(copies.sum() - copies.diag().sum())
    print("  combine (forward: the results back) is the same table transposed; the backward runs both again")
    print(
        f"  of {int(copies.sum())} copies, {away} leave their rank: {away * row_bytes:,} B each way, "
        f"{4 * away * row_bytes:,} B a step's forward and backward through this one layer"
    )


def memory(args: argparse.Namespace, block) -> None:
    """Part 3: the experts' bytes per rank to train (fp32 weight, gradient, Adam's two moments)."""
    experts = sum(p.numel() for p in block.experts.parameters())
    router = sum(p.numel() for p in block.gate.parameters())
    print("\n3. memory per rank: the experts' weights, gradients and Adam's moments (16 B a parameter)\n")
    each = experts // EXPERTS
    print(f"  this layer: {experts:,} expert parameters ({each:,} each) and {router:,} in the router")
    print(f"    without ep: every rank holds all {EXPERTS}: {experts * 16 / KIB:,.0f} KiB")
    held = experts * 16 / args.ep / KIB
    print(f"    with ep {args.ep}: each rank holds {EXPERTS // args.ep}: {held:,.0f} KiB (the router, "
          "attention and norms stay whole)")  # fmt: skip
    from pipeclock.plan.cluster_config import Config, Job, Software
    from pipeclock.plan.cluster_memory import gpu_memory
    from pipeclock.plan.hf_paper import paper_model, read_config

    model = paper_model(read_config(CLUSTER / "deepseek-v3.json"), "DeepSeek-V3")
    print("  DeepSeek-V3 (256 experts a layer) on 2,048 GPUs, pp 16 x dp 128, ZeRO-1, fp8, the planner's "
          "fullest GPU:")  # fmt: skip
    for ep in (1, 8, 64):
        config = Config(1, 16, 128, "dualpipev", 2, 1, 120, "selective-op", 1, False, ep)
        used = gpu_memory(model, config, Job(15360, 4096), Software("fp8", True))
        states = used.weights + used.gradients + used.optimizer
        print(
            f"    ep {ep:<3} weights, gradients and optimizer state {states / GIB:6.1f} GiB, in all "
            f"{used.total / GIB:6.1f} GiB{'  (an 80 GB GPU holds 80 GiB)' if ep == 1 else ''}"
        )


def overlap() -> None:
    """Part 4: the all-to-all hidden by DualPipeV's pairs, against 1F1B, in the simulator."""
    from pipeclock.engine.actions import join_first_stage_backwards
    from pipeclock.engine.generators import generate
    from pipeclock.engine.program import lower
    from pipeclock.observe.exchange import exchange_time, paired
    from pipeclock.observe.simulate import simulate

    print("\n4. what DualPipeV overlaps: 4 stages, 16 micro-batches; a stage's F 1, B 2 (I 1 + W 1), and its "
          "all-to-alls 0.5 in F and 0.5 in B\n")  # fmt: skip
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    for name, chunks in (("1f1b", 1), ("dualpipev", 2)):
        schedule = join_first_stage_backwards(generate(name, 4, 16, chunks))
        share = {op: cost / chunks for op, cost in costs.items()}
        sent = 0.5 / chunks

        def exchange(_rank, action, sent=sent):
            return sent if action.op in ("F", "B", "I") else 0.0

        time = exchange_time(schedule, lambda _r, a, share=share: share[a.op], exchange)
        step = simulate(schedule, share, exchange=exchange).makespan
        free = simulate(schedule, share).makespan
        print(
            f"  {name:<10} all-to-all {time.total:5.1f}, hidden {time.hidden:6.1%}; step {step:5.2f} "
            f"against {free:5.2f} with free all-to-alls ({step / free - 1:+.1%})"
        )
        if name == "dualpipev":
            program = lower(schedule)[0]
            first, second = next(iter(paired(program).items()))
            f, b = (
                f"{program[i].kind}{program[i].microbatch} of stage {program[i].stage}"
                for i in (first, second)
            )
            print(f"  rank 0's first pair: the {f} beside the {b}:")
            print(
                f"    the {f.split()[0]}'s dispatch and combine run while the {b.split()[0]} computes, "
                "and the other way"
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.ep < 1 or EXPERTS % args.ep:
        print(f"lab 14: error: --ep {args.ep} does not divide the layer's {EXPERTS} experts", file=sys.stderr)
        raise SystemExit(2)
    print("Lab 14: experts across ranks, in one process\n")
    block = moe_block(args.seed)
    chosen = routing(args, block)
    exchange(args, chosen)
    memory(args, block)
    overlap()


if __name__ == "__main__":
    run_as_script(main)
