"""Measured against predicted: each pipeclock case's median step beside the simulator's, fed with the
op times that case measured (``python -m benchmarks.predicted benchmarks/results/v.json``).

The simulator knows no message costs, so its step is what the schedule's order allows on ranks that
never wait for data: the difference is the messages and the engine's own time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeclock.engine.generators import generate
from pipeclock.observe.simulate import simulate


def rows(results: dict) -> list[str]:
    lines = [
        "| m | schedule | pipeclock step (ms) | predicted from its op times (ms) | torch step (ms) "
        "| torch's class |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in results["runs"][:1]:
        for case in (record for record in run if record["kind"] == "case"):
            ours = case["engines"]["pipeclock"]
            costs = dict(ours["compute_ms"])
            if case["schedule"] in ("zb-h1", "zb-v") and "I" not in costs:
                costs["I"] = costs.pop("B")  # results measured before the I op was named
            table = generate(case["schedule"], case["stages"], case["microbatches"], case["chunks"])
            predicted = simulate(table, costs).makespan
            theirs = case["engines"].get("torch", {}).get("median_s")
            torch_ms = f"{theirs * 1e3:.0f}" if theirs else "-"
            measured = f"{ours['median_s'] * 1e3:.0f} | {predicted:.0f}"
            name = case["torch_schedule"] or "-"
            lines.append(
                f"| {case['microbatches']} | {case['schedule']} | {measured} | {torch_ms} | {name} |"
            )
    return lines


def main() -> None:
    for path in sys.argv[1:]:
        print("\n".join(rows(json.loads(Path(path).read_text()))))


if __name__ == "__main__":
    main()
