"""A plan's memory per rank as a picture: one stacked bar per rank, the device's memory as a line."""

from __future__ import annotations

from pathlib import Path

from pipeclock.plan.planner import Plan

COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#55a868",
    "optimizer": "#c44e52",
    "activations": "#dd8452",
    "messages": "#8172b3",
    "workspace": "#937860",
    "runtime": "#8c8c8c",
}


def draw_memory(plan: Plan, device_memory: int, path: str | Path, binary: bool = False) -> Path:
    """Draw ``plan``'s memory per rank into ``path`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, size = ("GiB", 2**30) if binary else ("GB", 10**9)
    ranks = list(range(len(plan.memory)))
    figure, axes = plt.subplots(figsize=(max(4.0, 0.6 * len(ranks) + 2), 3.5))
    bottom = [0.0] * len(ranks)
    for part, color in COLORS.items():
        heights = [getattr(memory, part) / size for memory in plan.memory]
        axes.bar(ranks, heights, bottom=bottom, color=color, label=part)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axes.axhline(device_memory / size, color="black", linestyle="--", linewidth=1, label="device memory")
    axes.set_xlabel("rank")
    axes.set_ylabel(unit)
    axes.set_xticks(ranks)
    axes.set_title(f"{plan.schedule}, p={plan.stages}, m={plan.microbatches}: memory per rank")
    axes.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
