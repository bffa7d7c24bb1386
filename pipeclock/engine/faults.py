"""Deliberate deaths, to prove a run survives them: ``PIPECLOCK_FAULT=place:rank:step``.

A rank of a pipeline can die anywhere: in a forward, blocked on a receive, while the loss is shared, half-way
through a checkpoint. Each such place is marked in the code with ``faults.point(place, step)``; the train
command arms this module from the environment, and the rank named there SIGKILLs itself (no goodbye, no
cleanup, as a crashed machine) the first time it reaches the place at that step::

    PIPECLOCK_FAULT=W:1:3              rank 1 dies at its first W of step 3
    PIPECLOCK_FAULT=F:1:1,save:0:2     attempt 0 dies at F, torchrun's next attempt in a save; then clean

The k-th fault of the list is for torchrun's k-th attempt (``TORCHELASTIC_RESTART_COUNT``), so a job
started with ``--max-restarts K`` can die at K places in turn; an attempt past the list runs clean.
``step`` counts the steps done when the place is reached (the index of the step under way); for
``save`` it is the checkpoint's step, for ``resume`` the step resumed from.

Unarmed, a point costs one call that compares a module global with None.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

VARIABLE = "PIPECLOCK_FAULT"

# Each place, where exactly the rank dies there.
PLACES: dict[str, str] = {
    "F": "in a forward: its output computed, not yet sent",
    "B": "in a whole backward: the input gradient computed, not yet sent",
    "I": "in an input-gradient backward: the gradient computed, not yet sent",
    "W": "in a weight-gradient backward, before it runs",
    "send": "right after posting an activation's send, which is still in flight",
    "recv": "in a receive: the activation's receive posted, about to wait for it",
    "gather": "as a step opens, before the ranks holding the pipeline's ends send every rank the batch size",
    "loss": "as a step closes, before the last stage sends every rank the loss",
    "save": "half-way through a checkpoint save: every rank's file written, the directory not yet renamed",
    "resume": "during a resume, before loading its share of the checkpoint",
}


@dataclass(frozen=True)
class Fault:
    place: str
    rank: int
    step: int

    def __str__(self) -> str:
        return f"{self.place}:{self.rank}:{self.step}"


_armed: Fault | None = None  # this process's fault, when it has one


def parse(text: str) -> list[Fault]:
    """The faults of ``PIPECLOCK_FAULT``'s value, one per attempt (an empty value: none)."""
    return [_parse_one(item.strip()) for item in text.split(",") if item.strip()]


def _parse_one(item: str) -> Fault:
    parts = item.split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{VARIABLE}: {item!r} is not place:rank:step (e.g. W:1:3)")
    if parts[0] not in PLACES:
        raise ValueError(f"{VARIABLE}: unknown place {parts[0]!r}; places: {', '.join(PLACES)}")
    return Fault(parts[0], int(parts[1]), int(parts[2]))


def arm(world_size: int, environ: Mapping[str, str] = os.environ) -> Fault | None:
    """Read ``PIPECLOCK_FAULT`` once; returns (and arms) the fault this rank has in this attempt, if any.

    Raises ``ValueError`` for a value that does not parse or names a rank the world does not have.
    """
    global _armed
    attempt, rank = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(environ.get("RANK", "0"))
    try:
        faults = parse(environ.get(VARIABLE, ""))
    except ValueError as error:
        raise ValueError(f"rank {rank}: {error}") from None
    for fault in faults:
        if fault.rank >= world_size:
            raise ValueError(
                f"rank {rank}: {VARIABLE}: {fault} names rank {fault.rank}, but the world has {world_size}"
            )
    fault = faults[attempt] if attempt < len(faults) else None
    _armed = fault if fault is not None and fault.rank == rank else None
    return _armed


def disarm() -> None:
    global _armed
    _armed = None


def point(place: str, step: int) -> None:
    """A place where a rank may die: the armed rank does, at its fault's place and step."""
    if _armed is not None and _armed.place == place and _armed.step == step:
        _die(_armed)


def _die(fault: Fault) -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(
        f"pipeclock fault: rank {fault.rank} SIGKILLs itself at {fault.place} of step {fault.step} "
        f"(attempt {attempt})",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)
