"""A message between two ranks, and the wait for it: where the ranks meet ``comms``' timeout.

``isend`` / ``irecv`` post a tensor's send or receive and return at once (the orchestrator's hot path,
where shapes are agreed once and cached); ``wait`` waits for posted work at most the timeout ``comms.init``
set, and ``explain`` turns the backend's ``RuntimeError`` into a ``CommError`` naming this rank, the ranks
it waited on and the cause (``pipeclock.comm_errors``), after leaving this rank's note for the others and
reading theirs (``pipeclock.comm_blame``). This rank's number and device are looked up once per process
group, not once per message: the hot path sends thousands of messages a second.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeclock import comm_blame, comm_channels, comm_errors
from pipeclock.comm_errors import CommError

_timeout: float = 60.0
_rank: int | None = None
_device: torch.device | None = None


def set_timeout(seconds: float) -> None:
    """Every later wait here lasts at most ``seconds`` (``comms.init``)."""
    global _timeout
    _timeout = float(seconds)


def forget() -> None:
    """The process group ended (``comms.shutdown``): this rank's number and device are looked up again."""
    global _rank, _device
    _rank = _device = None


def device() -> torch.device:
    """Where this rank computes: its own GPU under nccl, else the CPU."""
    global _device
    if _device is None or not dist.is_initialized():
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        _device = torch.device("cuda", local_rank()) if nccl else torch.device("cpu")
    return _device


def timeout() -> float:
    """The timeout (seconds) that bounds every blocking call."""
    return _timeout


def local_rank() -> int:
    """This process's rank on its machine (torchrun's ``LOCAL_RANK``; 0 without torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_rank() -> int:
    global _rank
    if not dist.is_initialized():
        return 0
    if _rank is None:
        _rank = dist.get_rank()
    return _rank


# --- waiting with a timeout, and errors that say what happened ----------------------------------------


_ANYONE = object()  # the group when a caller does not say which ranks it waited on


def wait(work: dist.Work, what: str, peer: int | None = None, group=_ANYONE) -> None:
    """Wait for ``work`` at most the timeout; turn gloo/nccl errors into a ``CommError`` naming ranks.

    ``peer`` is the rank a point-to-point call waits on; for a collective, the other ranks of ``group``
    (None: the whole world).
    """
    try:
        work.wait(datetime.timedelta(seconds=_timeout))
    except RuntimeError as error:
        raise explain(error, what, peer, group) from error


def explain(error: RuntimeError, what: str, peer: int | None = None, group=_ANYONE) -> CommError:
    """The ``CommError`` that says what a backend's ``RuntimeError`` means, naming this rank and the
    ranks it waited on: ``peer``, else the other ranks of ``group`` (None: the world), else "a peer".

    A lost or silent peer also leaves this rank's note in the job's store, and reads the others' notes
    to say which rank failed first (``pipeclock.comm_blame``)."""
    others = _others(peer, group)
    kind = comm_errors.failure_kind(error)
    if kind == "other":
        return comm_errors.described(error, what, get_rank(), others, _timeout)
    comm_blame.leave_lost(others, closed=kind == "gone")
    first = comm_blame.first_failure(others, closed=kind == "gone")
    known = first is not None or not comm_blame.store_lost()
    return comm_errors.described(error, what, get_rank(), others, _timeout, first, known)


def _others(peer: int | None, group) -> list[int]:
    """The ranks a failed call waited on: ``peer`` if it is another rank, else the rest of ``group``."""
    me = get_rank()
    if peer is not None and peer != me:
        return [peer]
    if group is _ANYONE or not dist.is_initialized():
        return []
    return [r for r in dist.get_process_group_ranks(group or dist.group.WORLD) if r != me]


@contextlib.contextmanager
def explained(what: str) -> Iterator[None]:
    """Calls into a library that talks to the peers itself (FSDP, DDP): their failures as a ``CommError``."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as error:
        raise explain(error, what) from error


# --- unchecked non-blocking point-to-point (the orchestrator's hot path) ------------------------------


@dataclass
class PendingSend:
    """A send in flight; keep it (and so its tensor) until ``wait``."""

    work: dist.Work
    tensor: torch.Tensor
    dest: int
    what: str | None = None

    def wait(self) -> None:
        wait(self.work, _described(self.what, "sending", self.tensor.shape, "to", self.dest), self.dest)


@dataclass
class PendingRecv:
    """A receive in flight; ``wait`` returns the filled tensor."""

    work: dist.Work
    tensor: torch.Tensor
    src: int
    what: str | None = None

    def wait(self) -> torch.Tensor:
        wait(self.work, _described(self.what, "receiving", self.tensor.shape, "from", self.src), self.src)
        return self.tensor


def _described(what: str | None, doing: str, shape: torch.Size, preposition: str, peer: int) -> str:
    """How a message names itself in errors: the caller's words, or its shape, and the other rank."""
    return f"{what or f'{doing} a tensor of shape {tuple(shape)}'} {preposition} rank {peer}"


def _posted(
    post: Callable[[], dist.Work],
    what: str | None,
    doing: str,
    shape: torch.Size,
    preposition: str,
    peer: int,
) -> dist.Work:
    """Post a send or receive. Posting can fail at once, when the peer's connection is already closed
    (it died meanwhile): that is the same lost peer a wait would report, in the same words."""
    try:
        return post()
    except RuntimeError as error:
        raise explain(error, _described(what, doing, shape, preposition, peer), peer) from error


def isend(tensor: torch.Tensor, dest: int, tag: int = 0, what: str | None = None) -> PendingSend:
    """Start sending ``tensor`` to ``dest``; the receiver must post a matching ``irecv`` (same tag)."""
    tensor = tensor.detach().contiguous()
    group, peer = comm_channels.route(get_rank(), "to", dest)
    work = _posted(lambda: group.send([tensor], peer, tag), what, "sending", tensor.shape, "to", dest)
    return PendingSend(work, tensor, dest, what)


def irecv(
    shape: tuple[int, ...],
    src: int,
    dtype: torch.dtype = torch.float32,
    tag: int = 0,
    what: str | None = None,
) -> PendingRecv:
    """Start receiving a tensor of known ``shape``/``dtype`` from ``src``; ``what`` names it in errors."""
    tensor = torch.empty(shape, dtype=dtype, device=device())
    group, peer = comm_channels.route(get_rank(), "from", src)
    work = _posted(lambda: group.recv([tensor], peer, tag), what, "receiving", tensor.shape, "from", src)
    return PendingRecv(work, tensor, src, what)
