"""What a failed message or collective means, in words that name the ranks: the failure vocabulary.

``comms`` waits on the backend; when gloo or nccl raises, ``described`` turns its ``RuntimeError`` into
one of these errors, naming the rank that reports (alive, by construction) and the ranks it waited on,
and, where the stopped ranks' notes tell (``pipeclock.comm_blame``), which rank failed first. A process
group that never formed (``not_joined``, ``not_connected``) is said in the launcher's terms.
"""

from __future__ import annotations

import os
import re

from pipeclock.comm_blame import FirstFailure

__all__ = [
    "CommError",
    "CommTimeoutError",
    "PeerGoneError",
    "ShapeMismatchError",
    "described",
    "not_connected",
    "not_joined",
    "ranks_named",
]


class CommError(RuntimeError):
    """A point-to-point or collective call failed; the message names the ranks and the cause."""


class CommTimeoutError(CommError, TimeoutError):
    """A blocking call did not complete within the timeout given to ``init``."""


class PeerGoneError(CommError):
    """The connection to a peer broke: the peer process most likely died."""


class ShapeMismatchError(CommError, ValueError):
    """The receiver expected a different shape or dtype than the sender sent."""


def failure_kind(error: RuntimeError) -> str:
    """``"gone"`` (a connection closed), ``"timeout"``, or ``"other"``: what a backend's error says."""
    text = str(error)
    if "closed by peer" in text or "reset by peer" in text or "Broken pipe" in text:
        return "gone"
    if "imed out" in text or "timeout" in text.lower():
        return "timeout"
    return "other"


def described(
    error: RuntimeError,
    what: str,
    me: int,
    others: list[int],
    timeout: float,
    first: FirstFailure | None = None,
    store_known: bool = True,
) -> CommError:
    """The error ``error`` means for rank ``me``, which was ``what`` (waiting on ``others``, at most
    ``timeout`` seconds). Never ``me`` itself is suspected: the rank that reports is alive, the question
    is about the others. ``first``: the rank the stopped ranks' notes say failed first
    (``pipeclock.comm_blame``); ``store_known``: False when those notes could not be read."""
    text = str(error)
    who, other = f"rank {me}", ranks_named(others)
    kind = failure_kind(error)
    if kind == "gone":
        if first is not None:
            blamed = _first_failure(first)
        elif not store_known:
            logs = "its log" if len(others) <= 1 else "their logs"
            blamed = f"{other} stopped or died (see {logs}; which rank failed first is not known here)"
        elif len(others) <= 1:
            blamed = f"{other} most likely died (see its log)"
        else:
            blamed = f"one of {other} most likely died (see its log)"
        return PeerGoneError(f"{who}: lost the connection to {other} while {what}; {blamed}")
    if kind == "timeout":
        verb = "are" if len(others) > 1 else "is"
        known = f"; {_first_failure(first)}" if first is not None else ""
        return CommTimeoutError(
            f"{who}: {what} did not complete within {timeout:g}s; {verb} {other} alive and running the "
            f"same step and schedule?{known}"
        )
    return CommError(f"{who}: {what} failed: {text.splitlines()[0]}")


def _first_failure(first: FirstFailure) -> str:
    """``rank 3 most likely died first (rank 1 lost rank 2, rank 2 lost rank 3; see rank 3's log)``."""
    if first.error is not None:
        own = first.error.removeprefix(f"rank {first.rank}: ")
        return f"rank {first.rank} failed first: {own}"
    if len(first.path) == 1:
        return f"rank {first.rank} most likely died (see its log)"
    chain = ", ".join(f"rank {a} lost rank {b}" for a, b in zip(first.path, first.path[1:], strict=False))
    return f"rank {first.rank} most likely died first ({chain}; see rank {first.rank}'s log)"


def ranks_named(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 1, 2 and 3``, or ``a peer`` when no rank is known."""
    if not ranks:
        return "a peer"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


# --- joining: the process group that never formed --------------------------------------------------------


def not_joined(error: RuntimeError, timeout: float) -> CommTimeoutError:
    """What a rendezvous that never completed was waiting for, in the launcher's terms.

    The store's own messages speak of clients, sockets and keys; a user needs to know which rank did
    not come and what to check: that every rank started, and with the same world size.
    """
    rank, world = os.environ["RANK"], int(os.environ["WORLD_SIZE"])
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    missing = re.search(r"keys: .*/(\d+)\s*$", text)
    if joined:
        waited = f"the other ranks to join the store at {store} ({joined[1]} of {joined[2]} ranks came)"
    elif missing:
        waited = f"rank {missing[1]} to join the process group of {world} ranks"
    elif "connect" in text:
        waited = f"rank 0's store at {store} (rank 0 hosts it)"
    else:
        waited = f"the process group of {world} ranks ({text})"
    return CommTimeoutError(
        f"rank {rank}: waited {timeout:g}s for {waited}; did all {world} ranks start (WORLD_SIZE={world}: "
        "--nnodes x --nproc-per-node), with the same world size on every node?"
    )


def not_connected(error: RuntimeError, timeout: float) -> CommTimeoutError:
    """Gloo's links between the ranks, after the store, did not form: too short a timeout, or a peer that
    left meanwhile (refused); in the launcher's terms, not gloo's source locations."""
    rank, world = os.environ["RANK"], int(os.environ["WORLD_SIZE"])
    cause = "a peer refused: it had stopped already" if "refused" in str(error) else "no answer in time"
    return CommTimeoutError(
        f"rank {rank}: the {world} ranks met but could not connect to each other within {timeout:g}s "
        f"({cause}); is --timeout long enough, and did every rank start?"
    )
