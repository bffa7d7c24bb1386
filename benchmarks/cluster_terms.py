"""Where a one-stage row's predicted step goes, term by term, and what one term would have to cost for the
row to read its published speed (docs/cluster.md, the two small tp-1 rows).

    python -m benchmarks.cluster_terms            # the small rows and the neighbours they share terms with

On one pipeline stage (pp 1) the planner's step is a sum: each micro-batch's layers (their products'
FLOPs, the products' operands through memory, attention, the elementwise work, tensor parallel's exposed
collectives, recompute), the embedding, the head with its loss, then the exposed data-parallel exchange
and the optimizer. So if one term cost ``x`` times what the planner charges, the row would read its
published step when ``x = 1 + gap / term``, and every other row that shares the term's rule would move by
``(x - 1) * term`` of its own. A term can close a row's gap only if that multiple keeps the rows it shares
the rule with in line too; `closing` says, for each term, how far it takes them.
"""

from __future__ import annotations

import argparse
import dataclasses

from pipeclock.plan import activations, attention_core, calibration, cluster_time, gemm_efficiency
from pipeclock.plan.context_parallel import local_tokens
from pipeclock.plan.search import search

TERMS = ("products", "operands", "attention", "elementwise", "tp", "recompute", "embedding", "head")
TERMS += ("dp", "optimizer")
# the small rows, each with the rows of the same source run by the same software (the terms' rules)
# (source, run) as `benchmarks.cluster_check`'s table names them
NEMO, BRIDGE, MEGATRON = "NeMo 24.07 FP8", "Megatron-Bridge FP8", "Megatron-LM"
PAIRS = {
    (NEMO, "GPT3-5B, 64 GPUs"): (
        (NEMO, "GPT3-20B, 64 GPUs"),
        (NEMO, "LLAMA2-7B, 8 GPUs"),
        (BRIDGE, "Llama 3 8B, 8 GPUs, GBS 128 (25.11)"),
    ),
    (MEGATRON, "GPT 1.7B"): ((MEGATRON, "GPT 7.1B"), (MEGATRON, "GPT 16B"), (MEGATRON, "GPT 32B")),
}


@dataclasses.dataclass
class Terms:
    """A row's predicted step on its one stage, in seconds per term, and the published step."""

    name: str
    config: str
    seconds: dict[str, float]
    step: float  # the planner's
    published: float

    @property
    def gap(self) -> float:
        return self.published - self.step

    def error(self, extra: float = 0.0) -> float:
        """The speed error as the table reads it, (predicted - published) / published, with ``extra``
        seconds added to the predicted step."""
        return self.published / (self.step + extra) - 1

    def multiple(self, term: str) -> float:
        """What ``term`` would have to cost, as a multiple of the planner's, for the row to read its
        published step (infinite where the planner charges nothing for it)."""
        return 1 + self.gap / self.seconds[term] if self.seconds[term] else float("inf")


def terms(row) -> Terms:
    """The row's predicted step split into `TERMS` (a `benchmarks.cluster_check.Row` on one stage)."""
    found = search(row.model, row.cluster, row.job, row.software, row.fixed, top=1)
    best = found.ranked[0]
    config, model, job, software, gpu = best.config, row.model, row.job, row.software, row.cluster.kind
    if config.pp != 1:
        raise ValueError(f"{row.name}: a pipeline's step is not a sum of its terms (pp {config.pp})")
    rates = cluster_time.Rates(gpu, software)
    step = cluster_time.step_time(model, config, job, software, gpu)
    layer = cluster_time.layer_time(model, config, job, software, rates)
    tokens = local_tokens(config, job)
    products = operands = 0.0
    for gemm in model.gemms():
        seconds = cluster_time._gemm_seconds(gemm, tokens, model, config.tp, rates.a, rates)
        k = gemm.k / config.tp if gemm.split == "k" else gemm.k
        n = activations.output_width(model, gemm, config.tp, sp=False) if gemm.split == "n" else gemm.n
        share = gemm_efficiency.size_factor(k, n, gemm_efficiency.half_size(gpu.name))
        flops = 2.0 * tokens * k * n * gemm.count / (rates.gemm * share)
        products, operands = products + flops, operands + seconds - flops
    attention = model.attention_flops(job.seq_len) * tokens / config.tp / rates.attention
    kept = activations.layer_bytes(
        model, "none", rates.a, software.fused, config.tp, config.sequence_parallel
    )
    passes = calibration.ELEMENTWISE_PASSES["fused" if software.fused else "eager"]
    elementwise = passes * kept * tokens / rates.memory + attention_core.score_seconds(
        model, config, job, software, rates
    )
    ends = cluster_time._ends(model, config, tokens, software, rates)
    per_step = model.layers * config.microbatches
    tp = layer.forward + layer.input_grad - layer.recompute - 2 * products - 2 * operands
    tp -= 3.5 * attention + 3 * elementwise
    seconds = {
        "products": 3 * products * per_step,
        "operands": 3 * operands * per_step,
        "attention": 3.5 * attention * per_step,
        "elementwise": 3 * elementwise * per_step,
        "tp": tp * per_step,
        "recompute": layer.recompute * per_step,
        "embedding": (ends["first"]["F"] + ends["first"]["B"]) * config.microbatches,
        "head": (ends["last"]["F"] + ends["last"]["B"]) * config.microbatches,
        "dp": step.dp,
        "optimizer": step.optimizer,
    }
    speed = best.tflops_per_gpu / row.tflops if row.tflops else best.tokens_per_second_per_gpu / row.tokens
    return Terms(row.name, config.label(), seconds, step.step, step.step * speed)


def closing(small: Terms, others: list[Terms], term: str) -> tuple[float, dict[str, float]]:
    """The multiple of ``term`` that makes ``small`` read its published step, and each other row's error
    with its own ``term`` charged that multiple too."""
    multiple = small.multiple(term)
    moved = {}
    for other in others:
        extra = (multiple - 1) * other.seconds[term] if small.seconds[term] else 0.0
        moved[other.name] = other.error(extra) if multiple != float("inf") else float("nan")
    return multiple, moved


def report(names: dict[tuple, tuple[tuple, ...]] = PAIRS) -> str:
    """Each small row's terms beside its neighbours', and what each term's closing multiple does to them."""
    from benchmarks.cluster_check import rows

    by_name = {(row.source, row.name): row for row in rows()}
    lines = []
    for key, neighbours in names.items():
        small, others = terms(by_name[key]), [terms(by_name[name]) for name in neighbours]
        lines.append(
            f"## {' '.join(key)} (published step {small.published:.3f} s, planner's {small.step:.3f} s)"
        )
        lines.append("| row | step s | error | " + " | ".join(TERMS) + " |")
        lines.append("|---|---:|---:|" + "---:|" * len(TERMS))
        for each in [small, *others]:
            shares = " | ".join(f"{each.seconds[t] / each.step:.1%}" for t in TERMS)
            lines.append(f"| {each.name} | {each.step:.3f} | {each.error():+.1%} | {shares} |")
        lines.append("")
        lines.append("| term | multiple that closes the gap | " + " | ".join(o.name for o in others) + " |")
        lines.append("|---|---:|" + "---:|" * len(others))
        for term in TERMS:
            if small.seconds[term] <= 0.001 * small.step:
                continue
            multiple, moved = closing(small, others, term)
            errors = " | ".join(f"{moved[o.name]:+.1%}" for o in others)
            lines.append(f"| {term} | {multiple:.2f} | {errors} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(report())


if __name__ == "__main__":
    main()
