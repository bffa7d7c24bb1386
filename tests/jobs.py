"""torchrun jobs, launched as a user launches them, and what they leave: logs, losses, final lines.

``tests.distributed`` runs a function on gloo processes inside the test's own code; the tests here need the
real command line instead (``torchrun ... -m pipeclock train``), with its restarts, its signals and its
per-rank logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 240.0


class Launch:
    """One torchrun job, started now; ``result`` waits for it, ``stop`` kills what is left of it.

    Its output goes to files, not pipes: a job whose pipe nobody reads while others run would block.
    """

    def __init__(
        self,
        log: Path,
        stages: int,
        flags: list[str],
        *,
        restarts: int = 0,
        module: str = "pipeclock",
        rendezvous: list[str] | None = None,
        rank_logs: Path | None = None,
    ):
        """``rendezvous``: torchrun's flags for joining the job (default: ``--standalone``, one machine).
        ``rank_logs``: each rank's stderr goes to its own file there, per attempt (torchrun's
        ``--log-dir``, ``--redirects 2``), so that lines printed at once by two ranks cannot interleave."""
        env = dict(os.environ)
        if restarts:
            # torch 2.13's torchrun keeps one store across restarts, so a restarted group can read the dead
            # attempt's addresses and fail or hang (pytorch#135712); a store per attempt avoids it.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.command = [
            sys.executable, "-m", "torch.distributed.run", *(rendezvous or ["--standalone"]),
            "--nproc-per-node", str(stages),
            "--max-restarts", str(restarts),
            *(["--log-dir", str(rank_logs), "--redirects", "2"] if rank_logs else []),
            "-m", module, *flags,
        ]  # fmt: skip
        self.out, self.err = log.with_suffix(".out"), log.with_suffix(".err")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=out, stderr=err)

    def result(self) -> str:
        """The job's stdout; fails the test on a non-zero exit or a timeout."""
        try:
            self.proc.wait(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.stop()
        out, err = self.out.read_text(), self.err.read_text()
        assert self.proc.returncode == 0, f"{' '.join(self.command)}\n{out}\n{err}"
        return out

    def stop(self) -> None:
        """Kill torchrun and its workers (each worker leads its own session: killing a group misses it)."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            for worker in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    worker.kill()
        self.proc.kill()
        self.proc.wait()


def losses_of(path: Path) -> tuple[int, list[float]]:
    """What ``train --losses FILE`` wrote: the first step the run did, and its losses (exact floats)."""
    saved = json.loads(path.read_text())
    return saved["first_step"], saved["losses"]


def final_loss(log: str) -> str:
    """The loss on the last ``final loss`` line of a job's stdout, as printed."""
    return re.findall(r"^final loss ([\d.]+) after \d+ steps$", log, re.M)[-1]


def signal_group_when(process: subprocess.Popen, ready: str, signum: int, deadline: float) -> list[str]:
    """Read ``process``'s output until a line starts with ``ready``, then send ``signum`` to its whole
    process group (started with ``start_new_session``), as Ctrl-C in a terminal does; wait for it to end.
    The lines read are returned. Past ``deadline`` seconds the group is SIGKILLed: a hang fails the test.
    """
    killer = threading.Timer(deadline, os.killpg, (process.pid, signal.SIGKILL))
    killer.start()
    try:
        seen = []
        for line in process.stdout:
            seen.append(line)
            if line.startswith(ready):
                os.killpg(process.pid, signum)
                break
        assert seen and seen[-1].startswith(ready), "".join(seen)
        process.wait(timeout=deadline)
    finally:
        killer.cancel()
    return seen
