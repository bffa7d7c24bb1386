"""Where a context-parallel row's predicted step goes, term by term, pipelines included, and what one term
would have to cost for torchtitan's 405B rows (Table 6) to read their published speed.

    python -m benchmarks.cp_terms      # Table 6's terms, each term's closing multiple, and the other cp rows

A pipeline's step is not a sum of its actions, but with stages alike it is nearly one: the simulated
makespan is some number ``k`` of the slowest stage's forward and backward of one micro-batch (1F1B's
``m + pp - 1`` when messages are free) plus the messages, so a term costing ``t`` seconds in that stage's
forward and backward costs ``k x t`` of the step (`Split.critical`). On one stage ``k`` is the micro-batch
count. A layer's seconds split into attention (its forward, backward and recompute), the keys' and values'
exchange (what `pipeclock.plan.context_parallel.exchange` leaves exposed, forward, backward and the
forward rebuilt, less torch's merges), the merges, and the rest; the data-parallel collectives the step
does not hide (`StepTime.dp`) and the optimizer come on top. If a term cost ``x`` times the planner's,
a row would read its published step at ``x = 1 + gap / term``; a mechanism that multiplies a term must
give every row of the series one ``x`` and keep the other cp rows within 10 %.
"""

from __future__ import annotations

import argparse
import dataclasses

from benchmarks.cluster_terms import Terms
from pipeclock.plan import cluster_time, context_parallel
from pipeclock.plan.cluster_memory import placement_for, stage_layers
from pipeclock.plan.search import search

TERMS = ("attention", "exchange", "merges", "rest of the layers", "ends and messages", "dp", "optimizer")
LAYER_TERMS = TERMS[:4]
SERIES = "torchtitan T6"
# the other published cp rows, (source, run) as `benchmarks.cluster_check` names them
OTHERS = (
    ("torchtitan T2", "FSDP 4, CP 2, seq 65536"),
    ("torchtitan T2", "FSDP 2, CP 4, seq 131072"),
    ("torchtitan T2", "FSDP 1, CP 8, seq 262144"),
    ("NeMo 24.07 FP8", "LLAMA3-8B, 8 GPUs, cp 2"),
    ("NeMo 24.07 FP8", "LLAMA3-70B, 64 GPUs, cp 2"),
    ("Meta, Llama 3 Table 4", "Llama 3 405B, 16,384 GPUs, cp 16, seq 131,072"),
)


@dataclasses.dataclass
class Split(Terms):
    """A pipeline row's `Terms` (over `TERMS`), with its cp and its step's seconds per second of the
    slowest stage's F + B of one micro-batch (``critical``)."""

    cp: int
    critical: float


def layer_terms(model, config, job, software, rates) -> dict[str, float]:
    """One layer's forward, backward and recompute for one micro-batch on one rank, split into
    `LAYER_TERMS` (seconds)."""
    layer = cluster_time.layer_time(model, config, job, software, rates)
    tokens = context_parallel.local_tokens(config, job)
    attention = model.attention_flops(job.seq_len) * tokens / config.tp / rates.attention
    kv = context_parallel.exchange(model, config, job, software, rates.gpu, attention)
    merges = 0.0
    if config.cp > 1 and software.cp_exchange == "all-gather":
        forward, backward = context_parallel.merge_seconds(model, config, job, software, rates.gpu)
        merges = forward + backward + (forward if config.recompute == "full" else 0.0)
    rebuilt = config.recompute == "full"  # the forward rebuilt runs its attention and exchange again
    exchange = kv.forward * (2 if rebuilt else 1) + kv.backward - merges
    attention_all = attention * (1 + 2.5 + (1 if rebuilt or config.recompute == "selective-attention" else 0))
    whole = layer.forward + layer.input_grad + layer.weight_grad
    return {"attention": attention_all, "exchange": exchange, "merges": merges,
            "rest of the layers": whole - attention_all - exchange - merges}  # fmt: skip


def split(row) -> Split:
    """The row's predicted step split into `TERMS` (a `benchmarks.cluster_check.Row`)."""
    best = search(row.model, row.cluster, row.job, row.software, row.fixed, top=1).ranked[0]
    config, model, job, software, gpu = best.config, row.model, row.job, row.software, row.cluster.kind
    rates = cluster_time.Rates(gpu, software)
    step = cluster_time.step_time(model, config, job, software, gpu)
    costs = cluster_time.stage_costs(model, config, job, software, rates)
    placement = placement_for(config.schedule, config.pp, config.chunks)
    per_rank = [sum(costs[s]["F"] + costs[s]["B"] for s in stages) for stages in placement.stages]
    slowest = max(range(config.pp), key=per_rank.__getitem__)
    layers = sum(len(stage_layers(model, config)[s]) for s in placement.stages[slowest])
    critical = step.pipeline / per_rank[slowest] if config.pp > 1 else config.microbatches
    each = layer_terms(model, config, job, software, rates)
    seconds = {term: critical * layers * each[term] for term in LAYER_TERMS}
    seconds["ends and messages"] = step.pipeline - sum(seconds.values())
    seconds["dp"], seconds["optimizer"] = step.dp, step.optimizer
    speed = best.tflops_per_gpu / row.tflops if row.tflops else best.tokens_per_second_per_gpu / row.tokens
    name = f"{row.source} {row.name}"
    return Split(name, config.label(), seconds, step.step, step.step * speed, config.cp, critical)


def closing_link(row, low: float = 1.0, high: float = 20.0) -> float:
    """The factor the cp ranks' link (`context_parallel.link`: for Table 6, tp 8 x cp past a node, each
    GPU's NIC) would have to be divided by for ``row`` to read its published speed on its own
    configuration (``inf`` where no factor up to ``high`` does)."""
    best = search(row.model, row.cluster, row.job, row.software, row.fixed, top=1).ranked[0]
    config, gpu = best.config, row.cluster.kind
    target = best.tokens_per_second_per_gpu / row.tokens * cluster_time.step_time(
        row.model, config, row.job, row.software, gpu).step  # fmt: skip
    original = context_parallel.link

    def step(divisor: float) -> float:
        context_parallel.link = lambda c, g: original(c, g) / divisor
        try:
            return cluster_time.step_time(row.model, config, row.job, row.software, gpu).step
        finally:
            context_parallel.link = original

    if step(high) < target:
        return float("inf")
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) < target else (low, middle)
    return (low + high) / 2


def report() -> str:
    """Table 6's terms, each term's closing multiple at every cp, and what the largest of them does to
    the other published cp rows."""
    from benchmarks.cluster_check import rows

    table = rows()
    series = sorted((split(row) for row in table if row.source == SERIES), key=lambda s: s.cp)
    others = [split(row) for row in table if (row.source, row.name) in OTHERS]
    lines = [f"## {SERIES}: the planner's step by term (seconds), and the published step", "",
             "| cp | k | step | published | gap | " + " | ".join(TERMS) + " |",
             "|---:|---:|---:|---:|---:|" + "---:|" * len(TERMS)]  # fmt: skip
    for each in series:
        terms = " | ".join(f"{each.seconds[t]:.2f}" for t in TERMS)
        lines.append(f"| {each.cp} | {each.critical:.2f} | {each.step:.2f} | {each.published:.2f} | "
                     f"{each.gap:+.2f} | {terms} |")  # fmt: skip
    lines += ["", "| term | multiple that closes cp " + ", ".join(str(s.cp) for s in series) + " | "
              + " | ".join(o.name for o in others) + " (at the largest multiple) |",
              "|---|---|" + "---:|" * len(others)]  # fmt: skip
    for term in ("attention", "exchange", "merges", "dp"):
        multiples = [each.multiple(term) for each in series]
        finite = [x for x in multiples if x != float("inf")]
        largest = max(finite) if finite else float("inf")
        moved = " | ".join(
            f"{o.error((largest - 1) * o.seconds[term]):+.1%}" if finite else "-" for o in others
        )
        shown = ", ".join("-" if x == float("inf") else f"{x:.2f}" for x in multiples)
        lines.append(f"| {term} | {shown} | {moved} |")
    link = {row.fixed.get("cp", 1): row for row in table if row.source == SERIES}
    divisors = {cp: closing_link(row) for cp, row in sorted(link.items()) if cp > 1}
    shown = ", ".join(f"{d:.2f} (cp {cp})" for cp, d in divisors.items())
    lines += ["", f"the cp ranks' link divided by {shown} closes each row"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(report())


if __name__ == "__main__":
    main()
