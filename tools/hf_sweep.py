"""The family sweep: every causal-LM type of the installed ``transformers``, tiny, split and trained a step.

    python -m tools.hf_sweep                      # the table, printed
    python -m tools.hf_sweep --write              # and docs/hf/families.md's table rewritten
    python -m tools.hf_sweep llama mixtral        # some types only

Each type's tiny config (`tools.hf_families`) is built by ``transformers`` itself first: a type it cannot
build or run at that size is listed apart, as not built. Every other one lands in one of two classes:

- **exact**: one step of every schedule below, on virtual stages in this process, leaves the loss and
  every gradient within ``TOLERANCE`` (relative) of ``transformers``' own forward and backward on the
  same micro-batches (the loss of each, weighted by its counted tokens, as gradient accumulation does);
  the test suite runs the same families on 2 and 3 real processes (`tests/test_hf_families.py`);
- **refused**: ``pipeclock.models.hf.split`` (or the schedule) refuses it before any step, in one line.

Anything else (a traceback, a difference) is a failure, printed as such: the test asserts there is none.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools.hf_families import causal_lm_types, tiny_config

TOLERANCE = 2e-5
SEED = 5
BATCH, TOKENS, MICROBATCHES = 4, 8, 2
# (schedule, chunks, placement): whole and split backward, 1, 2, 3 and 6 virtual stages (6: every piece
# alone, the embedding's and the head's stages included)
RUNS = (
    ("1f1b", 1, "loop"),
    ("interleaved-1f1b", 3, "loop"),
    ("zb-v", 2, "v"),
    ("interleaved-1f1b", 6, "loop"),
)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "hf" / "families.md"


@dataclass
class Outcome:
    """What the sweep found for one model type."""

    model_type: str
    kind: str  # "exact", "refused", "not built", or "FAILED"
    detail: str = ""  # the refusal's line, what failed, or why transformers could not build it
    worst: float = 0.0  # the worst relative gap of an exact type
    seconds: float = 0.0
    gaps: dict = field(default_factory=dict)


def batch(vocab: int, seed: int = 0):
    """``(input_ids, attention_mask)`` and labels: sample 1 ends in two padding positions, one more
    label ignored."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(vocab, 100), (BATCH, TOKENS), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, TOKENS // 2] = -100
    return (ids, mask), labels


def reference(config, inputs, labels, step: int = 0) -> tuple[float, dict]:
    """``transformers``' own model with the split's weights and keys, fed the same micro-batches: the
    loss of each weighted by its share of the counted tokens, gradients accumulated.

    The loss is ``hf.loss``'s on the model's logits (next-token cross-entropy; plus the routers'
    auxiliary loss the model returns, as ``labels=`` adds it): a few families' own ``labels=`` loss
    does not shift (their labels are expected shifted already)."""
    from transformers import AutoModelForCausalLM

    from pipeclock import schedule
    from pipeclock.engine import rng
    from pipeclock.models import hf

    prepared = hf.build.prepared_config(config)
    model = AutoModelForCausalLM.from_config(prepared)
    model.load_state_dict(hf.whole(config, seed=SEED).state_dict())
    hf.keyed(model, SEED)
    model.train()
    ids, mask = inputs
    counted = int((labels[:, 1:] != -100).sum())
    total, start = 0.0, 0
    loss_fn = hf.loss(prepared)
    for size in schedule.microbatch_sizes(BATCH, MICROBATCHES):
        part = slice(start, start + size)
        with rng.keyed(step=step, first_sample=start):
            out = model(input_ids=ids[part], attention_mask=mask[part], use_cache=False)
        logits = (out.logits, out.aux_loss) if getattr(out, "aux_loss", None) is not None else out.logits
        loss = loss_fn(logits, labels[part]) / counted
        loss.backward()
        total += loss.item()
        start += size
    return total, {name: p.grad for name, p in model.named_parameters()}


def gap(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """The largest difference relative to the largest gradient entry (None counts as zeros)."""
    if got is None and want is None:
        return 0.0
    got = torch.zeros_like(want) if got is None else got
    want = torch.zeros_like(got) if want is None else want
    scale = want.abs().max().clamp_min(1e-12)
    return ((got - want).abs().max() / scale).item()


def worst_gap(loss: float, chunks, want_loss: float, want_grads: dict) -> float:
    from pipeclock.engine.ties import tie_key

    gaps = [abs(loss - want_loss) / max(abs(want_loss), 1e-12)]
    for chunk in chunks:
        for name, parameter in chunk.named_parameters():
            gaps.append(gap(parameter.grad, want_grads[tie_key(parameter) or name]))
    return max(gaps)


def one_type(model_type: str) -> Outcome:
    start = time.perf_counter()
    outcome = _one_type(model_type)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _one_type(model_type: str) -> Outcome:
    from pipeclock.models import hf

    try:
        config = tiny_config(model_type)
        inputs, labels = batch(getattr(config, "vocab_size", 100) or 100)
        _transformers_runs(config, inputs, labels)
    except Exception as error:
        return Outcome(model_type, "not built", _line(error))
    try:
        hf.split(config, 0, 1, seed=SEED)
    except ValueError as error:  # NotUnderstood and the other refusals
        return Outcome(model_type, "refused", _line(error))
    except Exception as error:
        return Outcome(model_type, "FAILED", f"split: {_line(error, True)}")
    try:
        want = reference(config, inputs, labels)
    except Exception as error:
        return Outcome(model_type, "FAILED", f"reference: {_line(error, True)}")
    gaps = {}
    for name, chunks, placement in RUNS:
        found = _run(config, name, chunks, placement, inputs, labels, want)
        if isinstance(found, Outcome):
            found.model_type = model_type
            return found
        gaps[f"{name} x{chunks}"] = found
    worst = max(gaps.values())
    if not worst <= TOLERANCE:
        bad = {k: f"{v:.2e}" for k, v in gaps.items() if not v <= TOLERANCE}
        return Outcome(model_type, "FAILED", f"differs from transformers: {bad}", worst, gaps=gaps)
    return Outcome(model_type, "exact", "", worst, gaps=gaps)


def _run(config, name: str, chunks: int, placement: str, inputs, labels, want) -> float | Outcome:
    from pipeclock import schedule
    from pipeclock.models import hf

    try:
        stages = hf.split(config, 0, 1, chunks=chunks, placement=placement, seed=SEED)
        stages = stages if isinstance(stages, list) else [stages]
        pipe = schedule.Pipeline(stages, name, MICROBATCHES, hf.loss(config))
    except ValueError as error:
        return Outcome("", "refused", f"{name}: {_line(error)}")
    except Exception as error:
        return Outcome("", "FAILED", f"{name} x{chunks} before the step: {_line(error, True)}")
    try:
        loss = pipe.step(inputs, labels)
    except Exception as error:
        return Outcome("", "FAILED", f"{name} x{chunks}: {_line(error, True)}")
    return worst_gap(loss, stages, *want)


def _transformers_runs(config, inputs, labels) -> None:
    """The tiny model as ``transformers`` builds it runs a forward and backward (else: not built)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(type(config).from_dict(config.to_dict()))  # some change it
    ids, mask = inputs
    model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()


def _line(error: BaseException, with_type: bool = False) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if with_type or not text else text


def sweep(types: Iterable[str] | None = None, echo: bool = False) -> list[Outcome]:
    """One `Outcome` per type (all of them by default), in order."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    outcomes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in types or causal_lm_types():
            outcomes.append(one_type(model_type))
            if echo:
                o = outcomes[-1]
                print(f"{o.model_type:28} {o.kind:9} {o.worst:8.1e} {o.seconds:5.1f}s {o.detail}", flush=True)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """The docs page's tables: the refused types with their reasons, then the counts."""
    counts = {
        kind: sum(o.kind == kind for o in outcomes) for kind in ("exact", "refused", "not built", "FAILED")
    }
    worst = max((o.worst for o in outcomes if o.kind == "exact"), default=0.0)
    lines = [
        f"{counts['exact']} exact (worst relative gap {worst:.1e}), {counts['refused']} refused, "
        f"{counts['not built']} not built by transformers at tiny size, {counts['FAILED']} failed.",
        "",
        "| type | refused because |",
        "|---|---|",
    ]
    lines += [f"| {o.model_type} | {o.detail} |" for o in outcomes if o.kind == "refused"]
    lines += ["", "| type | not built at tiny size |", "|---|---|"]
    lines += [f"| {o.model_type} | {o.detail} |" for o in outcomes if o.kind == "not built"]
    if counts["FAILED"]:
        lines += ["", "| type | FAILED |", "|---|---|"]
        lines += [f"| {o.model_type} | {o.detail} |" for o in outcomes if o.kind == "FAILED"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOCS}")
    args = parser.parse_args(argv)
    outcomes = sweep(args.types or None, echo=True)
    print(table(outcomes))
    return 0 if not any(o.kind == "FAILED" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
