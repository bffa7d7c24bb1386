"""How much of expert parallel's all-to-all DualPipeV hides, against 1F1B, in the simulator.

    python -m benchmarks.exchange_overlap

A DeepSeek-like case: the cluster planner's costs for DeepSeek-V3's run (benchmarks.moe_check: 2,048
H800s, pp 16 x ep 64 x dp 128, fp8, one sequence of 4,096 tokens a micro-batch): each stage's compute
and its all-to-alls for one micro-batch, in seconds. Each schedule's program is simulated with them
(`pipeclock.observe.simulate`, all-to-alls charged by `pipeclock.observe.exchange`), with ``m``
micro-batches a step. The figure is the simulator's: what a GPU would show is in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeclock.engine.actions import join_first_stage_backwards, placement_of
from pipeclock.engine.generators import generate
from pipeclock.observe.exchange import exchange_time
from pipeclock.observe.simulate import simulate
from pipeclock.plan.cluster_config import PP_OUTERMOST, Config, Job, Software
from pipeclock.plan.cluster_time import Rates, stage_costs

PP, MICROBATCHES = 16, 120  # the run's 120 sequences a replica, one a micro-batch
SCHEDULES = (("1f1b", 1), ("dualpipev", 2))


@dataclass(frozen=True)
class Overlap:
    schedule: str
    all_to_all: float  # seconds, summed over the ranks
    hidden: float  # its share run under another micro-batch's compute
    makespan: float  # seconds, with the all-to-alls
    without: float  # seconds, with all-to-alls that cost nothing


def deepseek_costs(chunks: int) -> list[dict[str, float]]:
    """The planner's per-virtual-stage costs for DeepSeek-V3's layout (compute with all-to-alls in F, B, I,
    and the all-to-alls alone in xF, xB)."""
    from benchmarks.moe_check import CONFIGS
    from pipeclock.plan.gpus import load_spec
    from pipeclock.plan.hf_paper import paper_model, read_config

    model = paper_model(read_config(CONFIGS / "deepseek-v3.json"), "DeepSeek-V3")
    schedule = "dualpipev" if chunks == 2 else "1f1b"
    config = Config(1, PP, 128, schedule, chunks, 1, MICROBATCHES, "selective-op", 1, False, 64)
    software = Software("fp8", True, False, rank_order=PP_OUTERMOST)
    return stage_costs(
        model, config, Job(15360, 4096), software, Rates(load_spec(CONFIGS / "h800.json"), software)
    )


def overlap(schedule: str, chunks: int, costs: list[dict[str, float]], pp: int = PP, m: int = MICROBATCHES):
    """``schedule`` on ``pp`` ranks and ``m`` micro-batches with these per-stage costs: the all-to-all's
    seconds, the share hidden, and the step with and without it."""
    table = join_first_stage_backwards(generate(schedule, pp, m, chunks))
    placement = placement_of(table)
    inside = {"F": "xF", "B": "xB", "I": "xB"}

    def exchange(rank: int, action) -> float:
        return costs[placement.stage(rank, action.chunk)].get(inside.get(action.op, ""), 0.0)

    def compute(rank: int, action) -> float:
        return costs[placement.stage(rank, action.chunk)][action.op] - exchange(rank, action)

    time = exchange_time(table, compute, exchange)
    with_it = simulate(table, compute, exchange=exchange).makespan
    without = simulate(table, compute).makespan
    return Overlap(schedule, time.total, time.hidden, with_it, without)


def main() -> None:
    print(
        "| schedule | all-to-all s (all ranks) | hidden | step s | step s, all-to-all free | what it costs |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for schedule, chunks in SCHEDULES:
        o = overlap(schedule, chunks, deepseek_costs(chunks))
        print(
            f"| {o.schedule} | {o.all_to_all:.2f} | {o.hidden:.1%} | {o.makespan:.2f} | {o.without:.2f} | "
            f"{o.makespan / o.without - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
