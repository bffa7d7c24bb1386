"""How busy the whole machine was: other people's processes share these cores.

The kernel counts, machine-wide, the CPU time spent busy (``/proc/stat``: user, nice, system, interrupts,
and steal, the time the hypervisor gave to another guest). Over a step, that count minus the CPU time
our own ranks used is the *foreign* load: what other processes took from the cores while we measured.
A step with next to no foreign load is a quiet step; the report gives its figures beside the others.
Resolution is one clock tick (10 ms on most Linux systems), fine for steps of tenths of a second.
"""

from __future__ import annotations

import os
from pathlib import Path

QUIET = 0.05  # a step is quiet when other processes used less than this share of the machine
_STAT = Path("/proc/stat")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (not idle, not iowait)


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot, or None where the kernel does not say."""
    try:
        with _STAT.open() as stat:
            fields = stat.readline().split()[1:]
    except OSError:
        return None
    return sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields)) / _TICK


def cores() -> int:
    """The cores this process may run on (the machine's, unless an affinity mask says otherwise)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
