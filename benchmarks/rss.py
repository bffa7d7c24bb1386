"""Peak resident memory of this process over a window, from the kernel's own high-water mark.

Linux keeps a process's peak RSS (``VmHWM`` in ``/proc/self/status``) and lets the process reset it by
writing ``5`` to ``/proc/self/clear_refs``. Resetting before a step and reading after gives the step's
peak, even though two engines share the process. Elsewhere the current RSS is the best we can read.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import psutil

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak() -> None:
    """Start a new window: the next ``peak_bytes`` covers only what happens from now on."""
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")


def peak_bytes() -> int:
    """The most resident memory this process held since the last ``reset_peak`` (or since it started)."""
    return _status_bytes("VmHWM")


def current_bytes() -> int:
    """The resident memory of this process now."""
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        match = None
    return int(match.group(1)) * 1024 if match else psutil.Process().memory_info().rss
