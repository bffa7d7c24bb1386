"""``python -m benchmarks.run``: pipeclock against torch.distributed.pipelining and one process, end to end.

    python -m benchmarks.run             # the full sweep (p in {2, 4}, hidden in {512, 1024, 2048}, ...)
    python -m benchmarks.run --quick     # two ranks, hidden 512 and 1024, m in {2, 4, 8}
    python -m benchmarks.run --targets --runs 3   # the issue's target cases, three times over
    python -m benchmarks.run --small-actions   # least compute per action: hidden 512 with m <= 2, m = 1
    python -m benchmarks.run --least-compute --steps 30   # hidden 512, m <= 2 only, 30 steps a case

For each number of stages the worker runs under torchrun (two ranks also measure T1), then the overhead
worker runs on two ranks. Results go to ``benchmarks/results/<name>.json`` (every record of every run)
and ``<name>.md`` (the tables); the plots to ``docs/figures/bench_*.png``. ``make bench`` and
``python -m pipeclock bench`` run the same thing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import figures, plan, report
from benchmarks.launch import ROOT, torchrun
from benchmarks.results_model import Results, Run
from pipeclock.cli.arguments import positive_float, positive_int

PLANS = {
    "full": plan.full,
    "quick": plan.quick,
    "targets": plan.targets,
    "small-actions": plan.small_actions,
    "least-compute": plan.least_compute,
    "tiny": plan.tiny,
    "v": plan.v_schedules,
    "program": plan.program,
    "overhead": plan.nothing,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_const", dest="plan", const="quick", help="a smaller sweep")
    which.add_argument(
        "--targets", action="store_const", dest="plan", const="targets", help="only the target cases"
    )
    which.add_argument(
        "--small-actions",
        action="store_const",
        dest="plan",
        const="small-actions",
        help="only the cases with the least compute per action (hidden 512 with m <= 2, m = 1)",
    )
    which.add_argument(
        "--least-compute",
        action="store_const",
        dest="plan",
        const="least-compute",
        help="only hidden 512 with m <= 2, on 2 and 4 ranks",
    )
    which.add_argument(
        "--tiny", action="store_const", dest="plan", const="tiny", help="a smoke run of a few seconds"
    )
    which.add_argument(
        "--v", action="store_const", dest="plan", const="v", help="zb-v against zb-h1, 1f1b and torch's ZB-V"
    )
    which.add_argument(
        "--program", action="store_const", dest="plan", const="program",
        help="the cases benchmarks.program_prediction sets beside the simulator",
    )  # fmt: skip
    which.add_argument(
        "--overhead-only",
        action="store_const",
        dest="plan",
        const="overhead",
        help="only the engine overhead",
    )
    parser.set_defaults(plan="full")
    parser.add_argument(
        "--runs", type=positive_int, default=1, help="repeat the sweep; cells show median [low–high]"
    )
    parser.add_argument(
        "--steps", type=positive_int, help="timed steps per case and engine (default: the plan's, 2-10)"
    )
    parser.add_argument("--name", help="results file name (default: the plan's name)")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=ROOT / "benchmarks" / "results",
        help="where the JSON and tables go",
    )
    parser.add_argument(
        "--figures-dir", type=Path, default=ROOT / "docs" / "figures", help="where the bench_*.png plots go"
    )
    parser.add_argument("--no-figures", action="store_true", help="write no plots")
    parser.add_argument("--no-overhead", action="store_true", help="skip the per-action overhead measurement")
    parser.add_argument(
        "--timeout", type=positive_float, default=1800.0, help="seconds one torchrun launch may take"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="measure nothing: rewrite the tables and plots from results JSON files (their runs pooled)",
    )


def run_once(chosen: plan.Plan, plan_path: Path, out: Path, args: argparse.Namespace) -> Run:
    """One run of the plan: a launch per number of stages (two ranks measure T1), then the overhead."""
    for stages in sorted({2, *chosen.stage_counts}) if chosen.cases else []:
        print(f"-- {stages} ranks", flush=True)
        extra = ["--baseline"] if stages == 2 else []
        torchrun(
            "benchmarks.worker", stages, ["--plan", str(plan_path), "--out", str(out), *extra], args.timeout
        )
    if not args.no_overhead:
        print("-- engine overhead, 2 ranks", flush=True)
        light = ["--steps", "5", "--schedules", "1f1b"] if args.plan == "tiny" else ["--steps", "30"]
        torchrun("benchmarks.overhead", 2, ["--out", str(out), *light], args.timeout)
    return Run([json.loads(line) for line in out.read_text().splitlines()])


def rewrite(args: argparse.Namespace) -> int:
    """The tables and plots again, from the records earlier sweeps saved (several files: runs pooled)."""
    saved = [json.loads(path.read_text()) for path in args.from_json]
    keep = (lambda r: r["kind"] != "case" or r["target"]) if args.plan == "targets" else (lambda r: True)
    results = Results([Run([r for r in records if keep(r)]) for data in saved for records in data["runs"]])
    name = args.name or "-".join(path.stem for path in args.from_json)
    command = "; ".join(data["command"] for data in saved)
    seconds = [s for data in saved for s in data["seconds"]]
    cases = tuple(case for data in saved for case in plan.from_json(data["plan"]).cases)
    written = write(results, plan.Plan(cases, {}), name, command, seconds, args)
    print("\n".join(f"wrote {path}" for path in written))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        return rewrite(args)
    chosen = PLANS[args.plan]()
    if args.steps:
        chosen = plan.with_steps(chosen, args.steps)
    name = args.name or args.plan
    command = getattr(args, "command_line", None) or shlex.join(
        ["python", "-m", "benchmarks.run", *sys.argv[1:]]
    )
    runs, seconds = [], []
    with tempfile.TemporaryDirectory(prefix="pipeclock-bench-") as scratch:
        plan_path = Path(scratch) / "plan.json"
        plan_path.write_text(json.dumps(plan.to_json(chosen)))
        for index in range(args.runs):
            print(f"== run {index + 1} of {args.runs}: {len(chosen.cases)} cases", flush=True)
            start = time.perf_counter()
            runs.append(run_once(chosen, plan_path, Path(scratch) / f"run{index}.jsonl", args))
            seconds.append(time.perf_counter() - start)
    results = Results(runs)
    written = write(results, chosen, name, command, seconds, args)
    print("\n".join(f"wrote {path}" for path in written))
    return 0


def write(
    results: Results, chosen: plan.Plan, name: str, command: str, seconds: list[float], args
) -> list[Path]:
    args.results_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "command": command,
        "seconds": seconds,
        "plan": plan.to_json(chosen),
        "runs": [r.records for r in results.runs],
    }
    json_path = args.results_dir / f"{name}.json"
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    md_path = args.results_dir / f"{name}.md"
    md_path.write_text(report.markdown(results, command, seconds))
    written = [json_path, md_path]
    if not args.no_figures and results.keys:
        written += figures.draw_all(results, args.figures_dir)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
