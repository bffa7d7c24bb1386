"""Which machine a timing was taken on, and how loaded it was: the line that goes with every printed time.

A step time means little without its machine: the same lab on a quiet laptop and on a shared 2-core
server can differ tenfold. So the labs end their output with `timing_context`: the processor (or the
GPU), the cores this process may use, and the 1-minute load average when the run ended, which counts
the run's own processes too (two ranks busy on two cores read about 2).
"""

from __future__ import annotations

import os
import platform

import torch


def processor() -> str:
    """The CPU's model name as the kernel gives it, else what Python knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "an unnamed CPU"


def cores() -> int:
    """The cores this process may run on (the machine's, unless an affinity mask says otherwise)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> float | None:
    """The machine's 1-minute load average, or None where the system does not give one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def timing_context() -> str:
    """``timings taken on <CPU>, 2 cores (no GPU); load average 3.12 over the last minute, this run
    included``: one line to print under any measured time."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    load = load_average()
    loaded = "load average unknown" if load is None else f"load average {load:.2f} over the last minute"
    return f"timings taken on {processor()}, {cores()} cores ({gpu}); {loaded}, this run included"
