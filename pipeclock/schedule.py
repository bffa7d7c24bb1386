"""The engine's public face: micro-batches, the Action IR, the schedules, and the Pipeline that runs them.

    from pipeclock import schedule
    schedule.split_microbatches(batch, 4)          # sizes differ by at most one
    schedule.one_f_one_b(4, 8)                      # rank by rank: [[F0, F1, F2, F3, B0, ...], ...]
    schedule.zb_v(4, 8).placement                   # the V: rank r holds stages r and 2p - 1 - r
    schedule.save_csv(schedule.dualpipev(4, 8), "dualpipev.csv"); schedule.load_csv("dualpipev.csv")
    pipe = schedule.Pipeline(stage, schedule="1f1b", num_microbatches=8)
    loss = pipe.step(inputs, targets)

The pieces live in their own modules (``actions``, ``generators``, ``microbatch``, ``orchestrator``);
this module gathers the names a user needs.
"""

from pipeclock.engine.actions import Action, Schedule, parse_schedule, placement_of, validate
from pipeclock.engine.csv_schedule import ScheduleFileError, load_csv, save_csv
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
from pipeclock.engine.orchestrator import BatchRefused, Pipeline, StepRecord
from pipeclock.engine.placement import Placement
from pipeclock.engine.v_schedules import dualpipev, zb_v

__all__ = [
    "SCHEDULES",
    "Action",
    "BatchRefused",
    "Pipeline",
    "Placement",
    "Schedule",
    "ScheduleFileError",
    "StepRecord",
    "TokenCrossEntropy",
    "bubble_formula",
    "bubble_formula_text",
    "dualpipev",
    "generate",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "load_csv",
    "microbatch_sizes",
    "naive",
    "one_f_one_b",
    "parse_schedule",
    "placement_of",
    "save_csv",
    "split_microbatches",
    "validate",
    "zb_v",
    "zero_bubble_h1",
]
