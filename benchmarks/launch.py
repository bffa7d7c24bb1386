"""Starting torchrun for a worker, with a deadline, and leaving no process behind.

torchrun starts one process per rank. If a sweep overruns its deadline, killing torchrun alone would
orphan the ranks, so torchrun gets a session (and process group) of its own and the whole group is ended,
politely first. Only this group is touched: it holds exactly the processes this launch started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class LaunchError(RuntimeError):
    """A worker launch failed or overran its deadline."""


def torchrun(module: str, nproc: int, args: list[str], timeout: float) -> None:
    """Run ``python -m module args`` on ``nproc`` local ranks; raise ``LaunchError`` unless it succeeds."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        module,
        *args,
    ]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    env.setdefault("OMP_NUM_THREADS", "1")  # comms.init sets the real count; this silences torchrun's notice
    process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(process)
        raise LaunchError(
            f"{module} on {nproc} ranks did not finish within {timeout:.0f}s; stopped"
        ) from None
    except BaseException:
        _end_group(process)
        raise
    if code != 0:
        raise LaunchError(f"{module} on {nproc} ranks failed (exit code {code}); see the output above")


def _end_group(process: subprocess.Popen) -> None:
    """Terminate torchrun and its ranks (its process group); kill whatever is left after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10.0)
