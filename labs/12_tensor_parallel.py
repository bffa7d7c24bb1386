"""Lab 12: tensor parallel inside a stage: split each layer's matrices across the ranks of one stage.

A pipeline cuts a model between layers; tensor parallel cuts inside them. An MLP's two Linears split the
Megatron way: the first by its output features (a column split: each rank computes its own features,
whole), the second by its input features (a row split: each rank multiplies its own slice and gets a
partial product of every output). One all-reduce sums the partial products forward; one sums the
input's gradient backward. Between the two, nothing moves: the first split's output slice is exactly
the second split's input slice.

The lab runs the MLP three ways and holds each to one process:

1. by hand: the column- and row-parallel Linears of ``labs/solutions/tensor_parallel.py`` (write your
   own in ``labs/exercises/tensor_parallel.py``; ``python -m pipeclock lab 12 --check FILE`` checks it);
2. torch's own tensor parallel: ``parallelize_module`` with ``ColwiseParallel`` and ``RowwiseParallel``,
   parameters as DTensors: the same slices, the same collectives, the same numbers;
3. pipeline and tensor parallel together, pp 2 x tp 2 on 4 processes, with pipeclock's main job (what
   ``train --tp 2`` runs): the mesh drawn, what each rank holds, the losses beside one process's.

Run it:  torchrun --nproc-per-node 4 labs/12_tensor_parallel.py      (or: python -m pipeclock lab 12)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from solutions.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pipeclock import comms
from pipeclock.cli.interrupts import run_as_script
from pipeclock.models.mlp import ShardedMLP
from pipeclock.parallel.mesh import pipelines
from pipeclock.training.loop import TrainConfig, train
from pipeclock.training.task_choice import make_task

PROCESSES = 4  # how many processes `python -m pipeclock lab 12` asks torchrun for
TP = 2  # part 3: ranks per stage
NAMES = {"0.weight": "up.weight", "0.bias": "up.bias", "2.weight": "down.weight", "2.bias": "down.bias"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 12: tensor parallel inside a stage")
    parser.add_argument(
        "--hidden", type=int, default=64, help="parts 1-2: the MLP is hidden -> 4 hidden -> hidden"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--layers", type=int, default=4, help="part 3: Linear layers of the ShardedMLP")
    parser.add_argument("--width", type=int, default=256, help="part 3: the ShardedMLP's width")
    parser.add_argument("--steps", type=int, default=5, help="part 3: training steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# --- the MLP on one process ----------------------------------------------------------------------------


def make_mlp(hidden: int, seed: int) -> nn.Sequential:
    """``up`` (hidden -> 4 hidden), a ReLU, ``down`` (4 hidden -> hidden), every weight and bias seeded."""
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.ReLU(), nn.Linear(4 * hidden, hidden))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / hidden**0.5)
    return model


@dataclass
class Outcome:
    """One forward and backward of the MLP: what a rank holds of it afterwards."""

    output: torch.Tensor
    input_grad: torch.Tensor
    held: dict[str, torch.Tensor]  # this rank's part of each parameter
    grads: dict[str, torch.Tensor]  # and of its gradient
    collectives: tuple[str, str] = ("", "")  # forward, backward


def run(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Outcome:
    """Forward, mean-squared-error loss, backward, each phase's collectives counted by torch's
    ``CommDebugMode`` (it sees both ``dist.all_reduce`` and DTensor's collectives)."""
    x = x.clone().requires_grad_()
    with CommDebugMode() as forward:
        output = model(x)
        loss = F.mse_loss(output, target)
    with CommDebugMode() as backward:
        loss.backward()
    held = {name: local(p) for name, p in model.named_parameters()}
    grads = {name: local(p.grad) for name, p in model.named_parameters()}
    # torch's row split returns its sum still in flight (an AsyncCollectiveTensor): a copy waits for it
    return Outcome(output.detach().clone(), x.grad, held, grads, (counted(forward), counted(backward)))


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


def counted(mode: CommDebugMode) -> str:
    counts = {}
    for op, count in mode.get_comm_counts().items():
        name = "all-reduce" if "all_reduce" in str(op) or "allreduce" in str(op) else str(op)
        counts[name] = counts.get(name, 0) + count
    return ", ".join(f"{count} {name}" for name, count in counts.items()) or "none"


def by_hand(model: nn.Sequential, rank: int, world: int) -> nn.Sequential:
    """The MLP with its Linears replaced by the hand-written splits (labs/solutions/tensor_parallel.py)."""
    up, down = ColumnParallelLinear(model[0], rank, world), RowParallelLinear(model[2], rank, world)
    return nn.Sequential(up, nn.ReLU(), down)


def with_torch(model: nn.Sequential, world: int) -> nn.Sequential:
    """The same split by torch: ``parallelize_module`` on a one-dim mesh of every rank."""
    mesh = init_device_mesh(comms.device().type, (world,), mesh_dim_names=("tp",))
    return parallelize_module(copy.deepcopy(model), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


# --- parts 1 and 2: what each rank holds, and how far from one process --------------------------------


def locate(whole: torch.Tensor, part: torch.Tensor) -> tuple[int, int] | None:
    """Where ``part`` lies in ``whole``: (dim, start) of the slice it equals; None when it is all of it."""
    if part.shape == whole.shape:
        return None
    dim = next(d for d in range(whole.dim()) if part.shape[d] != whole.shape[d])
    size = part.shape[dim]
    starts = range(0, whole.shape[dim] - size + 1, size)
    return dim, next(start for start in starts if torch.equal(whole.narrow(dim, start, size), part))


def where_in(whole: torch.Tensor, part: torch.Tensor) -> str:
    """Which slice of ``whole`` the tensor ``part`` is: ``rows 0-63 of 256``, ``0-63 of 256``, ``whole``."""
    found = locate(whole, part)
    if found is None:
        return "whole"
    dim, start = found
    words = ("rows ", "columns ") if whole.dim() == 2 else ("", "")
    return f"{words[dim]}{start}-{start + part.shape[dim] - 1} of {whole.shape[dim]}"


def holdings(model: nn.Sequential, outcome: Outcome) -> str:
    whole = dict(model.named_parameters())
    return ", ".join(
        f"{NAMES[name]} {where_in(whole[name].detach(), part)}" for name, part in outcome.held.items()
    )


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def gaps_to(reference: Outcome, outcome: Outcome, whole: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far ``outcome`` (a rank's part) is from ``reference`` (one process's, whole): the output, the
    input's gradient, and the worst weight gradient, each relative to the largest value."""
    grads = []
    for name, part in outcome.grads.items():
        found, want = locate(whole[name].detach(), outcome.held[name]), reference.grads[name]
        if found is not None:
            want = want.narrow(found[0], found[1], part.shape[found[0]])
        grads.append(relative_gap(part, want))
    return {
        "output": relative_gap(outcome.output, reference.output),
        "input gradient": relative_gap(outcome.input_grad, reference.input_grad),
        "weight gradients": max(grads),
    }


def worst(gathered: list[dict[str, float]]) -> dict[str, float]:
    return {key: max(g[key] for g in gathered) for key in gathered[0]}


def show_split(title: str, lines: list[str], outcome: Outcome, gaps: dict[str, float], against: str) -> None:
    print(title)
    for line in lines:
        print(f"  {line}")
    print(f"  collectives  forward: {outcome.collectives[0]}; backward: {outcome.collectives[1]}")
    shown = ", ".join(f"{key} {value:.1e}" for key, value in gaps.items())
    print(f"  against {against}, largest relative difference on any rank: {shown}\n")


def parts_one_and_two(args: argparse.Namespace, rank: int, world: int) -> None:
    device = comms.device()  # the CPU under gloo; this rank's GPU under nccl
    model = make_mlp(args.hidden, args.seed).to(device)
    generator = torch.Generator().manual_seed(args.seed + 1)
    x, target = (torch.randn(args.batch_size, args.hidden, generator=generator).to(device) for _ in range(2))
    whole = dict(model.named_parameters())
    reference = run(model, x, target)
    hand = run(by_hand(model, rank, world), x, target)
    torch_split = run(with_torch(model, world), x, target)
    hand_lines = comms.all_gather_object(f"rank {rank} keeps  {holdings(model, hand)}", "the splits")
    torch_lines = comms.all_gather_object(f"rank {rank} keeps  {holdings(model, torch_split)}", "the splits")
    hand_gaps = worst(comms.all_gather_object(gaps_to(reference, hand, whole), "the gaps"))
    same = {
        "output": relative_gap(torch_split.output, hand.output),
        "input gradient": relative_gap(torch_split.input_grad, hand.input_grad),
        "weight gradients": max(relative_gap(torch_split.grads[n], hand.grads[n]) for n in hand.grads),
    }
    torch_gaps = worst(comms.all_gather_object(same, "the gaps"))
    held = sum(part.numel() for part in hand.held.values())
    if rank == 0:
        shape = f"{args.hidden} -> {4 * args.hidden} -> {args.hidden}"
        print(f"Lab 12: tensor parallel inside a stage, on {world} processes\n")
        title = f"1. by hand (labs/solutions/tensor_parallel.py): the MLP {shape}, split over {world} ranks"
        total = sum(p.numel() for p in model.parameters())
        hand_lines.append(f"each rank keeps {held:,} of the MLP's {total:,} parameters ({held / total:.3f})")
        show_split(title, hand_lines, hand, hand_gaps, "one process")
        title = "2. torch's parallelize_module: ColwiseParallel on up, RowwiseParallel on down"
        show_split(title, torch_lines, torch_split, torch_gaps, "the split by hand")


# --- part 3: pp x tp with the main job -----------------------------------------------------------------


def mesh_picture(world: int, tp: int, stages: list[range]) -> list[str]:
    """The ranks as a grid: a row is a pipeline (one tp index), a column one stage's tp group."""
    rows, width = pipelines(world, 1, tp), 24
    cells = [f"stage {s} (layers {r.start}-{r.stop - 1})" for s, r in enumerate(stages)]
    lines = ["           " + "".join(f"{cell:<{width}}" for cell in cells).rstrip()]
    for t, ranks in enumerate(rows):
        arrow = " " + "-" * (width - len(f"rank {ranks[0]}") - 3) + "> "
        lines.append(f"tp rank {t}  " + arrow.join(f"rank {r}" for r in ranks))
        if t + 1 < len(rows):
            lines.append("           " + "".join(f"{'  ||':<{width}}" for _ in ranks).rstrip())
    lines.append('a row is a pipeline: its "pp" group carries activations forward and gradients back')
    lines.append('a column is one stage shared by its "tp" group: the all-reduces inside each layer pair')
    return lines


def described(parameter: torch.Tensor) -> str:
    """``rows 0-127 of 256``: a tensor-parallel parameter's shard on this rank, read from its DTensor."""
    if not isinstance(parameter, DTensor):
        return "whole"
    placement, part = parameter.placements[-1], parameter.to_local()
    if isinstance(placement, Replicate):
        return "whole"
    assert isinstance(placement, Shard)
    size, index = part.shape[placement.dim], parameter.device_mesh.get_local_rank()
    words = ("rows ", "columns ") if parameter.dim() == 2 else ("", "")
    return (
        f"{words[placement.dim]}{index * size}-{(index + 1) * size - 1} of {parameter.shape[placement.dim]}"
    )


def one_process_losses(config: TrainConfig) -> list[float]:
    """The same steps on one process: the whole ShardedMLP, the whole batch, the same Adam."""
    task = make_task(config)
    model = ShardedMLP(config.hidden, config.layers, stage=0, num_stages=1, seed=config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    losses = []
    for step in range(config.steps):
        inputs, targets = task.batch(step, config.batch_size)
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def part_three(args: argparse.Namespace, rank: int, world: int) -> None:
    config = TrainConfig(
        model="mlp", hidden=args.width, layers=args.layers, batch_size=args.batch_size, steps=args.steps,
        microbatches=4, schedule="1f1b", tp=TP, seed=args.seed,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(config)
    held = [f"{name} {described(p)}" for module in result.modules for name, p in module.named_parameters()]
    everyone = comms.all_gather_object(held, "what each rank holds")
    stages = [module.layer_indices for module in result.modules]
    cuts = comms.all_gather_object(stages[0], "the stages' layers")[::TP]
    if rank != 0:
        return
    pp = world // TP
    print(
        f"3. pp {pp} x tp {TP} on {world} processes, the main job (train --tp {TP}): ShardedMLP "
        f"{args.layers} x {args.width}, {config.schedule}, m = {config.microbatches}, {args.steps} steps"
    )
    print("\n".join("  " + line for line in mesh_picture(world, TP, cuts)))
    for owner, parts in enumerate(everyone):
        print(f"  rank {owner} holds  {', '.join(parts)}")
    alone = one_process_losses(config)
    print("  step  loss pp x tp   loss one process")
    for step, (ours, theirs) in enumerate(zip(result.losses, alone, strict=True)):
        print(f"  {step:4d}  {ours:.5f}      {theirs:.5f}")
    gap = max(abs(a - b) / abs(b) for a, b in zip(result.losses, alone, strict=True))
    print(f"  largest relative difference over the {args.steps} steps: {gap:.1e}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = comms.init()
    if world < 2 or world % TP:
        raise SystemExit(
            f"lab 12 splits layers over {TP} ranks or more: it needs an even number of processes"
        )
    parts_one_and_two(args, rank, world)
    part_three(args, rank, world)
    dist.barrier()
    comms.shutdown()


if __name__ == "__main__":
    run_as_script(main)
