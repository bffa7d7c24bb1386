"""``torchrun --nproc-per-node 2 -m benchmarks.expert_memory --ep N``: what a rank holds of a MoE's experts.

Two ranks, dp 2 (FSDP2), a Mixtral of 2 layers x 8 experts whose experts are most of its weights. Each
rank builds its stage, optionally divides the experts over ``--ep`` ranks, and runs two training steps
with Adam. It prints, per rank, the bytes its tensors hold after the steps (weights, gradients and Adam's
state, the experts' apart from the rest) and how far its resident memory rose above what it held once
built (``VmHWM`` from /proc, reset after the build): FSDP2 shards the experts too, but gathers them
whole for the step (and holds their whole gradients until the reduce-scatter); with ep each rank keeps
only its experts, whole, and their state.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

CONFIG = dict(  # experts: 2 layers x 8 x (2 x 1024 x 256 + 256 x 1024) = 12.6 M of 13.3 M parameters
    hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300, num_experts_per_tok=2, num_local_experts=8, output_router_logits=True,
    router_aux_loss_coef=0.01,
)  # fmt: skip
MIB = 2**20


def _resident(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def measure(ep: int) -> dict[str, float]:
    from transformers import MixtralConfig

    from pipeclock import comms, parallel, schedule
    from pipeclock.models import hf
    from pipeclock.parallel.experts import WithExperts, expert_parallel

    rank, _ = comms.init()
    torch.set_num_threads(1)
    mesh = parallel.init_mesh(2)
    config = MixtralConfig(**CONFIG)
    chunks = [hf.split(config, 0, 1, seed=0)]
    experts = expert_parallel(chunks, mesh, hf.ep_plan(config, ep), ep) if ep > 1 else None
    ignored = experts.parameters if experts else None
    replicas = parallel.data_parallel(chunks, mesh, "fsdp", ignored)
    sums = WithExperts(replicas, experts) if experts else replicas
    group = mesh.get_group("pp")
    pipe = schedule.Pipeline(replicas.chunks, "1f1b", 2, hf.loss(config), group=group, replicas=sums)
    optimizer = torch.optim.Adam([p for c in replicas.modules for p in c.parameters()], lr=1e-3)
    ids = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(rank))
    Path("/proc/self/clear_refs").write_text("5")
    built = _resident("VmRSS")
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        pipe.step(ids, ids)
        optimizer.step()
    grown = _resident("VmHWM") - built
    params = [p for c in replicas.modules for n, p in c.named_parameters()]
    is_expert = [".experts." in n for c in replicas.modules for n, _ in c.named_parameters()]
    state = optimizer.state
    found = {}
    for kind, chosen in (("experts", True), ("the rest", False)):
        mine = [p for p, e in zip(params, is_expert, strict=True) if e == chosen]
        adam = [s[k] for p in mine for k in ("exp_avg", "exp_avg_sq") for s in [state.get(p, {})] if k in s]
        found[kind] = (_bytes(mine) / MIB, _bytes(p.grad for p in mine) / MIB, _bytes(adam) / MIB)
    found["peak rise"] = grown / MIB
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    found = measure(args.ep)
    from pipeclock import comms

    everyone = comms.all_gather_object(found, "gathering the figures")
    if comms.get_rank() == 0:
        print(f"dp 2, ep {args.ep}: MiB per rank (weights / gradients / Adam state) after 2 steps")
        for rank, figures in enumerate(everyone):
            parts = "  ".join(f"{kind} {w:6.1f} / {g:6.1f} / {a:6.1f}" for kind, (w, g, a) in
                              ((k, figures[k]) for k in ("experts", "the rest")))  # fmt: skip
            print(
                f"rank {rank}: {parts}  resident peak rose {figures['peak rise']:6.1f} over the built stage"
            )
    comms.shutdown()


if __name__ == "__main__":
    main()
