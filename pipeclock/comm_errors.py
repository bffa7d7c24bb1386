"""What a failed message or collective means, in words that name the ranks: the failure vocabulary.

``comms`` waits on the backend; when gloo or nccl raises, ``described`` turns its ``RuntimeError`` into
one of these errors, naming the rank that reports (alive, by construction) and the ranks it waited on.
"""

from __future__ import annotations

__all__ = ["CommError", "CommTimeoutError", "PeerGoneError", "ShapeMismatchError", "described", "ranks_named"]


class CommError(RuntimeError):
    """A point-to-point or collective call failed; the message names the ranks and the cause."""


class CommTimeoutError(CommError, TimeoutError):
    """A blocking call did not complete within the timeout given to ``init``."""


class PeerGoneError(CommError):
    """The connection to a peer broke: the peer process most likely died."""


class ShapeMismatchError(CommError, ValueError):
    """The receiver expected a different shape or dtype than the sender sent."""


def described(error: RuntimeError, what: str, me: int, others: list[int], timeout: float) -> CommError:
    """The error ``error`` means for rank ``me``, which was ``what`` (waiting on ``others``, at most
    ``timeout`` seconds). Never ``me`` itself is suspected: the rank that reports is alive, the question
    is about the others."""
    text = str(error)
    who, other = f"rank {me}", ranks_named(others)
    if "closed by peer" in text or "reset by peer" in text or "Broken pipe" in text:
        died = f"{other} most likely died" if len(others) <= 1 else f"one of {other} most likely died"
        return PeerGoneError(f"{who}: lost the connection to {other} while {what}; {died} (see its log)")
    if "imed out" in text or "timeout" in text.lower():
        verb = "are" if len(others) > 1 else "is"
        return CommTimeoutError(
            f"{who}: {what} did not complete within {timeout:g}s; {verb} {other} alive and running the "
            "same step and schedule?"
        )
    return CommError(f"{who}: {what} failed: {text.splitlines()[0]}")


def ranks_named(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 1, 2 and 3``, or ``a peer`` when no rank is known."""
    if not ranks:
        return "a peer"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
