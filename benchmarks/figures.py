"""The scaling plots: step time against m and against p, and efficiency against m (PNG, Agg).

Solid lines are pipeclock, dashed lines torch on the same schedule (same colour), the dotted black line
the ideal step T1 / p * (m + p - 1) / m. Points are medians over the runs.

``python -m benchmarks.figures [RESULTS.json ...]`` redraws them from saved results without measuring
anything (``make docs`` does, so the course's figures all come from one command).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker

from benchmarks.launch import ROOT
from benchmarks.plan import SCHEDULES
from benchmarks.results_model import Results, Run, Spread

COLOURS = {
    "gpipe": "tab:blue",
    "1f1b": "tab:orange",
    "interleaved-1f1b": "tab:green",
    "zb-h1": "tab:red",
    "zb-v": "tab:purple",
}
ENGINES = (("pipeclock", "pipeclock_s", "-", "o"), ("torch", "torch_s", "--", "s"))


def _grid(rows: int, cols: int, title: str):
    figure, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    figure.suptitle(title)
    return figure, axes


def _median(spread: Spread | None) -> float | None:
    return spread.median if spread else None


def _plot(ax, xs: list[int], ys: list[float | None], **style) -> None:
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    if points:
        ax.plot(*zip(*points, strict=True), **style)


def step_vs_m(results: Results, path: Path) -> Path:
    """One panel per (p, hidden): step time (ms) against m, every schedule and both engines."""
    stages = sorted({k[0] for k in results.keys})
    hiddens = sorted({k[1] for k in results.keys})
    figure, axes = _grid(len(stages), len(hiddens), "Step time against micro-batches (batch 256)")
    for row, p in enumerate(stages):
        for col, hidden in enumerate(hiddens):
            ax = axes[row][col]
            ms = sorted({k[2] for k in results.keys if k[:2] == (p, hidden)})
            for name in SCHEDULES:
                keys = [(p, hidden, m, name) for m in ms]
                if not any(k in results.keys for k in keys):
                    continue
                for engine, field, line, marker in ENGINES:
                    ys = [_ms(results, k, field) for k in keys]
                    label = f"{engine} {name}" if row == col == 0 else None
                    _plot(ax, ms, ys, color=COLOURS[name], linestyle=line, marker=marker, label=label)
            ideal = [_ms(results, (p, hidden, m, "gpipe"), "ideal_s") for m in ms]
            _plot(ax, ms, ideal, color="black", linestyle=":", label="ideal" if row == col == 0 else None)
            _axes(ax, f"p = {p}, hidden = {hidden}", "micro-batches m", "step (ms)", ms)
    figure.legend(loc="lower center", ncol=5, fontsize=8, bbox_to_anchor=(0.5, -0.02))
    return _save(figure, path)


def step_vs_p(results: Results, path: Path, m: int = 8) -> Path:
    """One panel per hidden: step time against p at a fixed m, every schedule and both engines."""
    hiddens = sorted({k[1] for k in results.keys})
    figure, axes = _grid(1, len(hiddens), f"Step time against stages (m = {m}, batch 256)")
    for col, hidden in enumerate(hiddens):
        ax = axes[0][col]
        stages = sorted({k[0] for k in results.keys if k[1:3] == (hidden, m)})
        for name in SCHEDULES:
            for engine, field, line, marker in ENGINES:
                ys = [_ms(results, (p, hidden, m, name), field) for p in stages]
                label = f"{engine} {name}" if col == 0 else None
                _plot(ax, stages, ys, color=COLOURS[name], linestyle=line, marker=marker, label=label)
        ideal = [_ms(results, (p, hidden, m, "gpipe"), "ideal_s") for p in stages]
        _plot(ax, stages, ideal, color="black", linestyle=":", label="ideal" if col == 0 else None)
        _axes(ax, f"hidden = {hidden}", "stages p", "step (ms)", stages)
    figure.legend(loc="lower center", ncol=5, fontsize=8, bbox_to_anchor=(0.5, -0.08))
    return _save(figure, path)


def efficiency_vs_m(results: Results, path: Path) -> Path:
    """One panel per (p, hidden): ideal / measured step against m.

    The ideal is T1 / p * (m + p - 1) / m, but never below T1 / cores: with more ranks than cores (p = 4
    on two cores) the formula's p-fold speed-up is out of reach for any engine.
    """
    stages = sorted({k[0] for k in results.keys})
    hiddens = sorted({k[1] for k in results.keys})
    title = "Efficiency against m: max(T1/p·(m+p−1)/m, T1/cores) / measured step"
    figure, axes = _grid(len(stages), len(hiddens), title)
    for row, p in enumerate(stages):
        for col, hidden in enumerate(hiddens):
            ax = axes[row][col]
            ms = sorted({k[2] for k in results.keys if k[:2] == (p, hidden)})
            for name in SCHEDULES:
                for engine, field, line, marker in (
                    ("pipeclock", "eff_floor_pipeclock", "-", "o"),
                    ("torch", "eff_floor_torch", "--", "s"),
                ):
                    ys = [_value(results, (p, hidden, m, name), field) for m in ms]
                    ys = [y * 100 if y is not None else None for y in ys]
                    label = f"{engine} {name}" if row == col == 0 else None
                    _plot(ax, ms, ys, color=COLOURS[name], linestyle=line, marker=marker, label=label)
            ax.axhline(100, color="black", linestyle=":", linewidth=1)
            _axes(ax, f"p = {p}, hidden = {hidden}", "micro-batches m", "efficiency (%)", ms, log_y=False)
    figure.legend(loc="lower center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, -0.02))
    return _save(figure, path)


def _value(results: Results, key, field: str) -> float | None:
    return _median(results.figures(key)[field]) if key in results.keys else None


def _ms(results: Results, key, field: str) -> float | None:
    value = _value(results, key, field)
    return value * 1e3 if value is not None else None


def _axes(ax, title: str, xlabel: str, ylabel: str, ticks: list[int], log_y: bool = True) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if len(ticks) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
    ax.grid(True, alpha=0.3)


def _save(figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def draw_all(results: Results, directory: Path) -> list[Path]:
    """Every plot under ``directory``, named ``bench_*.png``."""
    ms = {key[2] for key in results.keys}
    return [
        step_vs_m(results, directory / "bench_step_vs_m.png"),
        step_vs_p(results, directory / "bench_step_vs_p.png", m=8 if 8 in ms else max(ms)),
        efficiency_vs_m(results, directory / "bench_efficiency_vs_m.png"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__.splitlines()[0])
    parser.add_argument(
        "results",
        type=Path,
        nargs="*",
        default=[ROOT / "benchmarks" / "results" / "full.json"],
        help="results JSON files, their runs pooled (default: the full sweep's)",
    )
    parser.add_argument("--figures-dir", type=Path, default=ROOT / "docs" / "figures")
    args = parser.parse_args(argv)
    saved = [json.loads(path.read_text()) for path in args.results]
    results = Results([Run(records) for data in saved for records in data["runs"]])
    for path in draw_all(results, args.figures_dir):
        print(f"drew {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
