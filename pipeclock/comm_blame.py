"""Which rank failed first: notes the stopping ranks leave in the job's store, read by the survivors.

When rank 3 of four dies, rank 2 loses its connection and stops; then rank 1 loses rank 2, and rank 0
loses rank 1. Each survivor sees only its own neighbour go, so each would blame a rank that did not fail
first. So a rank that stops on an error leaves one note, before its connections close, in the c10d store
the ranks met through (torchrun's agent's; or rank 0's, without torchrun or with a store per restart):

- ``lost 2``: its connection to rank 2 closed (rank 2's process ended);
- ``waited 2``: it gave up waiting on rank 2 (rank 2 may still be alive, waiting on someone else);
- ``failed: <its error line>``: it stopped on an error of its own (``leave_failure``).

A survivor that loses a peer follows the notes from that peer (rank 1 lost 2, rank 2 lost 3) to the rank
where they end: a ``failed`` note is the first failure, in its own words; a rank that left no note but
whose connection another rank lost is the rank that most likely died first. An end reached only through
``waited`` notes, or a store that cannot be reached (it lived in rank 0, which is gone), names nobody: a
living rank is never named as dead. A process keeps its first note only.

The notes are best effort, and asking for them must not cost the user the one line the rank prints:
a store that lived in the rank whose connection closed is not asked at all; any other is asked with
torch's C++ log lines (a client's retries, with stack frames) sent nowhere, each call waited for a few
seconds at most; and a call still waiting then is left behind, for the process to end without it
(``end_at_once``: ``python -m pipeclock`` then ends with ``os._exit``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

# On an error path: a busy store gets time to answer, a store that is gone fails at once. Each call to the
# store runs in a thread of its own, waited for at most _STORE_TIMEOUT + _MARGIN: a store whose process is
# dying may accept a connection and never answer, and a client then waits past any timeout it was given,
# while torchrun kills a rank it stopped 30 s later: this rank's one line must come before. An error path
# makes three calls at most (connect, leave a note, read the notes): 3 x 8 s leaves 6 s of the 30, and a
# busy machine's store 7 s to answer (5 s was once too few at a load of 18 on 2 cores). The margin lets a
# call that fails on its own timeout print its C++ lines while they still go nowhere.
_STORE_TIMEOUT = datetime.timedelta(seconds=7)
_MARGIN = 1.0
T = TypeVar("T")
_store: dist.Store | None = None
_unreachable = False  # tried once, and the store was not there: not tried again (each try waits)
_left_note = False
_left_behind = False  # a call to the store outlived its wait, and is still in C++ in a thread of its own


@dataclass(frozen=True)
class FirstFailure:
    """Where the notes end: ``rank``, and its own error line (None: it left none, so it most likely died);
    ``path`` the ranks the notes went through from the peer this rank lost."""

    rank: int
    error: str | None
    path: tuple[int, ...]


def start_group() -> None:
    """A new process group begins (``comms.init``): notes, and the store they go to, are its own."""
    global _store, _unreachable, _left_note
    _store, _unreachable, _left_note = None, False, False


def leave_lost(ranks: list[int], closed: bool) -> None:
    """This rank stops because its connection to ``ranks`` closed (``closed``) or it timed out on them."""
    _forget_a_store_gone_with(ranks, closed)
    if ranks:
        _leave(("lost " if closed else "waited ") + " ".join(map(str, ranks)))


def leave_failure(line: str) -> None:
    """This rank stops on an error of its own: ``line`` is what it printed."""
    _leave(f"failed: {line}")


def first_failure(lost: list[int], closed: bool) -> FirstFailure | None:
    """Where the notes lead from the ranks this rank lost (``closed``: their connections closed; else it
    timed out on them). None when they lead nowhere certain or the store cannot be reached."""
    _forget_a_store_gone_with(lost, closed)
    notes = _read_notes()
    if notes is None:
        return None
    ends = {end for peer in lost if (end := _follow(peer, closed, notes)) is not None}
    return ends.pop() if len(ends) == 1 else None


def store_lost() -> bool:
    """Whether the notes were looked for and the store was not there (it lived in a rank that is gone)."""
    return _unreachable


def end_at_once() -> bool:
    """Whether this process, its one line printed, should end with ``os._exit`` rather than by the
    interpreter's exit: it stopped on an error among peers (torchrun then SIGTERMs the ranks still
    running, and one still in the interpreter's exit, a second with torch loaded, dies of it: exit code
    -15, not its own), or a call to the store is still waiting in C++ in a thread (the interpreter's exit
    can abort under it: "terminate called without an active exception", exit code 134)."""
    return _left_note or _left_behind


def _forget_a_store_gone_with(ranks: list[int], closed: bool) -> None:
    """Without an agent to hold it (torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or no torchrun)
    the store lives in rank 0: when the connection to rank 0 closed, its process ended and the store with
    it. Not asked then: a client that finds it gone (or still closing) retries for its whole timeout. A
    collective that lost one of several ranks, rank 0 among them, does not say which: the store is asked."""
    global _store, _unreachable
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if closed and ranks == [0] and not agent_store:
        _store, _unreachable = None, True


def _follow(peer: int, closed: bool, notes: dict[int, str]) -> FirstFailure | None:
    path, rank, strong = [], peer, closed
    while rank not in path:
        path.append(rank)
        note = notes.get(rank)
        if note is None:
            return FirstFailure(rank, None, tuple(path)) if strong else None
        if note.startswith("failed: "):
            return FirstFailure(rank, note.removeprefix("failed: "), tuple(path))
        kind, *ranks = note.split()
        rank, strong = int(ranks[0]), kind == "lost"
    return None  # the notes go round in a circle: ranks that waited on each other


def _key(rank: int) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"pipeclock/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}/stopped/{rank}"


def _leave(note: str) -> None:
    global _left_note
    if _left_note or not dist.is_initialized():
        return
    _left_note = True
    store, key = _connect(), _key(dist.get_rank())
    if store is not None:
        _bounded(lambda: store.set(key, note))


def _read_notes() -> dict[int, str] | None:
    store = _connect()
    if store is None or not dist.is_initialized():
        return None
    keys = [_key(rank) for rank in range(dist.get_world_size())]
    return _bounded(
        lambda: {rank: store.get(key).decode() for rank, key in enumerate(keys) if store.check([key])}
    )


def _connect() -> dist.Store | None:
    """A client of the store the ranks met through (a connection of its own, with a short timeout)."""
    global _store, _unreachable
    if _store is None and not _unreachable and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

        def dial() -> dist.Store:
            # a plain socket first: a store that is gone fails it at once, not after the client's retries
            socket.create_connection((host, port), timeout=_STORE_TIMEOUT.total_seconds()).close()
            return dist.TCPStore(host, port, is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False)

        _store = _bounded(dial)
        _unreachable = _store is None
    return _store


def _bounded(call: Callable[[], T]) -> T | None:
    """``call()`` in a thread, waited for ``_STORE_TIMEOUT`` and a margin at most, with the process's
    standard error sent nowhere meanwhile; None if it failed or is still waiting (the thread is left to
    its wait: the process does not wait for it to end, ``end_at_once``)."""
    global _left_behind
    result: list[T] = []

    def attempt() -> None:
        with contextlib.suppress(OSError, RuntimeError, dist.DistError):
            result.append(call())

    thread = threading.Thread(target=attempt, name="pipeclock-blame-store", daemon=True)
    with _standard_error_discarded():
        thread.start()
        thread.join(_STORE_TIMEOUT.total_seconds() + _MARGIN)
    _left_behind = _left_behind or thread.is_alive()
    return result[0] if result else None


@contextlib.contextmanager
def _standard_error_discarded() -> Iterator[None]:
    """File descriptor 2 on ``/dev/null`` within the block: torch's C++ log lines (a store client's
    retries and timeouts, each with its stack frames) are written there, past anything ``sys.stderr`` holds.
    There is no public switch for that log but ``TORCH_CPP_LOG_LEVEL``, read once as torch loads, and
    for the whole process."""
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        kept = os.dup(2)
    except OSError:  # no standard error to begin with: nothing to keep from it
        yield
        return
    nowhere = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(nowhere, 2)
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
        os.close(nowhere)
