"""The engine's public face: micro-batches, the Action IR, the schedules, and the Pipeline that runs them.

    from pipeclock import schedule
    schedule.split_microbatches(batch, 4)          # sizes differ by at most one
    schedule.one_f_one_b(4, 8)                      # rank by rank: [[F0, F1, F2, F3, B0, ...], ...]
    pipe = schedule.Pipeline(stage, schedule="1f1b", num_microbatches=8)
    loss = pipe.step(inputs, targets)

The pieces live in their own modules (``actions``, ``generators``, ``microbatch``, ``orchestrator``);
this module gathers the names a user needs.
"""

from pipeclock.engine.actions import Action, parse_schedule, validate
from pipeclock.engine.generators import (
    SCHEDULES,
    bubble_formula,
    bubble_formula_text,
    generate,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    naive,
    one_f_one_b,
    zero_bubble_h1,
)
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.microbatch import microbatch_sizes, split_microbatches
from pipeclock.engine.orchestrator import Pipeline, StepRecord

__all__ = [
    "SCHEDULES",
    "Action",
    "Pipeline",
    "StepRecord",
    "TokenCrossEntropy",
    "bubble_formula",
    "bubble_formula_text",
    "generate",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "microbatch_sizes",
    "naive",
    "one_f_one_b",
    "parse_schedule",
    "split_microbatches",
    "validate",
    "zero_bubble_h1",
]
