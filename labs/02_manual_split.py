"""Lab 2: the memory wall, and cutting the model in two by hand.

A 10-billion-parameter model in fp32 needs 40 GB for its weights alone; an RTX 4090 has 24 GB. So the
model must be cut. Here we cut lab 1's ``nn.Sequential`` into ``part1`` and ``part2`` and train it by
handing the activation from one to the other ourselves, exactly as two devices would have to, then check
that the result is the one-piece model's, to float rounding.

The lesson: the forward hand-off (an activation) and the backward hand-back (its gradient) are ours to
manage; inside each part, autograd still does all the work.

Run it:  python labs/02_manual_split.py        (or: python -m pipeclock lab 2)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from pipeclock.cli.interrupts import run_as_script
from pipeclock.model import full_mlp, split_sequential
from pipeclock.models.regression import SyntheticRegression

GB = 1e9


def memory_wall(params: float = 10e9, device_gb: float = 24.0, device: str = "RTX 4090") -> None:
    """Print what a model of ``params`` fp32 parameters needs, against one device's memory."""
    weights = params * 4 / GB
    grads = params * 4 / GB
    adam = params * 8 / GB  # two fp32 moments per parameter
    training = weights + grads + adam
    print(f"The memory wall: a {params / 1e9:.0f}B-parameter model in fp32 (4 bytes per parameter)")
    print(f"  weights alone              {weights:6.0f} GB   vs {device_gb:.0f} GB on an {device}")
    print(f"  + gradients                {weights + grads:6.0f} GB")
    print(f"  + Adam's two moments       {training:6.0f} GB   (16 bytes per parameter, before activations)")
    print(f"  devices just to hold the weights: {math.ceil(weights / device_gb)}")
    print(
        f"  devices to train with Adam:       {math.ceil(training / device_gb)} (plus room for activations)\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lab 2: the memory wall, and a manual two-way split")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def split_step(part1, part2, inputs, targets) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One training step through two parts, with the hand-offs done by hand; returns the loss and the
    shape of what crossed the cut."""
    # Forward through part1, as "device A" would.
    activation = part1(inputs)
    # --- the cut. Device B receives a copy of the numbers, not A's autograd graph, so we make a fresh
    # leaf tensor: the graph ends here on A's side and starts again on B's.
    received = activation.detach().requires_grad_()
    loss = F.mse_loss(part2(received), targets)
    # Backward on B: autograd fills part2's .grad and the gradient of the received activation.
    loss.backward()
    # --- the hand-back. B sends received.grad to A, and A resumes backward from its own activation.
    activation.backward(received.grad)
    return loss.detach(), tuple(activation.shape)


def describe(part: torch.nn.Sequential) -> str:
    names = list(part._modules)
    linears = sum(isinstance(m, torch.nn.Linear) for m in part)
    return f"modules {names[0]}..{names[-1]} of the Sequential ({linears} Linear layers)"


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    memory_wall()

    whole = full_mlp(args.hidden, args.layers, seed=args.seed)  # lab 1's model
    part1, part2 = (
        split_sequential(full_mlp(args.hidden, args.layers, seed=args.seed), s, 2) for s in (0, 1)
    )
    for name, part in (("part1", part1), ("part2", part2)):
        print(f"{name} = {describe(part)}")

    data = SyntheticRegression(args.hidden, seed=args.seed)
    opt_whole = torch.optim.Adam(whole.parameters(), lr=args.lr)
    opt_split = torch.optim.Adam([*part1.parameters(), *part2.parameters()], lr=args.lr)
    loss_gap = grad_gap = 0.0
    for step in range(args.steps):
        inputs, targets = data.batch(step, args.batch_size)
        for opt in (opt_whole, opt_split):
            opt.zero_grad()
        loss_whole = F.mse_loss(whole(inputs), targets)
        loss_whole.backward()
        loss_split, handed_off = split_step(part1, part2, inputs, targets)
        grads_whole = [p.grad for p in whole.parameters()]
        grads_split = [p.grad for p in (*part1.parameters(), *part2.parameters())]
        loss_gap = max(loss_gap, abs(loss_whole.item() - loss_split.item()))
        grad_gap = max(grad_gap, max_difference(grads_whole, grads_split))
        if step == 0:
            print(f"hand-off: an activation of shape {handed_off} forward, its gradient back\n")
        opt_whole.step()
        opt_split.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(
                f"step {step:3d}  loss one piece {loss_whole.item():.6f}  two parts {loss_split.item():.6f}"
            )

    weight_gap = max_difference(list(whole.parameters()), [*part1.parameters(), *part2.parameters()])
    print(f"\nover {args.steps} steps, largest difference against the one-piece model:")
    print(f"  loss {loss_gap:.3g}   gradients {grad_gap:.3g}   weights after training {weight_gap:.3g}")


if __name__ == "__main__":
    run_as_script(main)
