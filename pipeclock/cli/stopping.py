"""When torchrun stops a rank because another died: let it first say what failed.

On one machine, torchrun's agent notices a dead worker within a tenth of a second and SIGTERMs the
others. A survivor that is that moment waiting on the dead rank would learn it a few milliseconds later
and print one clear error naming it (``lost the connection to rank 1 while ...``): the only account of
where the run broke when the dead rank said nothing (a SIGKILL, the OOM killer). Killed at once, it says
nothing either. So under torchrun a rank takes SIGTERM as notice: it goes on for at most ``grace``
seconds (the run's timeout, which bounds every wait it can be in), long enough for the failing wait to
return and be reported, and exits then, saying so, if nothing failed first. torchrun itself sends
SIGKILL 30 s after SIGTERM, whatever the grace.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def report_before_stopping(rank: int, grace: float) -> None:
    """From now on, SIGTERM stops this process ``grace`` seconds later, unless it ends before."""
    stopping: list[threading.Timer] = []

    def on_sigterm(signum: int, frame) -> None:
        if stopping:
            return
        timer = threading.Timer(grace, _stop, args=(rank, grace))
        timer.daemon = True  # a process that ends by itself does not wait for it
        stopping.append(timer)
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)


def _stop(rank: int, grace: float) -> None:
    print(
        f"pipeclock train: stopped: rank {rank} was sent SIGTERM and no error of its own came within "
        f"{grace:g}s (torchrun stops every rank when one fails: see the other ranks' lines)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signal.SIGTERM)
