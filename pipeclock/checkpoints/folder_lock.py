"""One run per checkpoint folder: the folder is locked for the run's life, and a second run is refused.

Two runs saving into one ``--checkpoint-dir`` would delete and rename each other's saves. So rank 0 of a
run takes an exclusive ``flock`` on the folder itself (opened read-only) before anything is read or
written there, and holds it until the run ends; a second run's rank 0 finds it taken and refuses.

Why an OS lock rather than a lease written in the folder: the kernel drops a ``flock`` when the process
holding it ends, however it ends (SIGKILL, the OOM killer, a crashed node's processes), so a dead run never
holds the folder and nothing needs cleaning up; a lease would need a renewal thread, a clock every machine
agrees on, and a wait for a dead run's lease to run out. Locking the folder rather than a file in it adds
no file beside the checkpoints. Who holds it is read from ``/proc/locks`` (Linux; the pid is only known
for a holder on this machine). On a network file system ``flock`` is only as good as the server's locking
(NFSv4 honours it between clients).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
from pathlib import Path

_PROC_LOCKS = Path("/proc/locks")


class FolderInUseError(ValueError):
    """Another live run holds the checkpoint folder."""


def lock(directory: str | os.PathLike) -> int:
    """Create ``directory`` if needed and lock it; the descriptor that holds the lock (``release`` it).

    Raises ``FolderInUseError`` naming the folder and its holder when another process holds it.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = holder_of(path)
        os.close(descriptor)
        raise FolderInUseError(
            f"--checkpoint-dir {directory} is in use by another run ({holder}); wait for it to end, "
            "or choose another folder"
        ) from None
    return descriptor


def release(descriptor: int) -> None:
    """Let the folder go (closing the descriptor drops the lock)."""
    with contextlib.suppress(OSError):
        os.close(descriptor)


def holder_of(path: Path) -> str:
    """``pid 1234 on host node7``: the process that holds ``path``'s lock, as this machine's kernel says."""
    status = path.stat()
    wanted = (os.major(status.st_dev), os.minor(status.st_dev), status.st_ino)
    with contextlib.suppress(OSError):
        for line in _PROC_LOCKS.read_text().splitlines():
            found = re.search(r"FLOCK\s+\S+\s+WRITE\s+(\d+)\s+([0-9a-f]+):([0-9a-f]+):(\d+)", line)
            if found and (int(found[2], 16), int(found[3], 16), int(found[4])) == wanted:
                return f"pid {found[1]} on host {socket.gethostname()}"
    return "a process on another machine, or one this machine does not show"
