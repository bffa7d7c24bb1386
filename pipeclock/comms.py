"""The glue: joining the process group, who is next in line, and moving tensors between ranks.

``init`` is "dialling in to the conference call": it reads the environment torchrun sets (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), picks nccl on CUDA and gloo on the CPU, and remembers a timeout
that every later blocking call here honours. Without torchrun it makes a one-process world, so the same
script runs on a laptop.

Two kinds of point-to-point call are known by their names here:

- ``send_tensor`` / ``recv_tensor`` are blocking and *checked*: a small header (dtype and shape) travels
  ahead of the data, so a receiver that expected another shape gets a clear error naming both ranks and
  both shapes instead of gloo aborting the process. With ``shape=None`` the receiver learns the shape.
  They live in ``pipeclock.comm_tensors``.
- ``isend`` / ``irecv`` (and ``send_meta`` / ``recv_meta`` for a one-off header) are non-blocking and
  unchecked: the orchestrator's hot path, where shapes are agreed once and cached
  (``pipeclock.comm_messages``, with the wait that bounds them all).

Every failure is a ``CommError`` whose message names this rank, the peer and the cause: a timeout
(``CommTimeoutError``), a peer that died (``PeerGoneError``) or a mismatch (``ShapeMismatchError``).
Those words are ``pipeclock.comm_errors``; this module and its ``comm_*`` helpers wait, and hand them
what they waited on.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from pipeclock import comm_blame, comm_channels, comm_errors, comm_messages

# The failure vocabulary lives in comm_errors; callers know it as comms.CommError, comms.PeerGoneError, ...
from pipeclock.comm_errors import CommError as CommError
from pipeclock.comm_errors import CommTimeoutError as CommTimeoutError
from pipeclock.comm_errors import PeerGoneError as PeerGoneError
from pipeclock.comm_errors import ShapeMismatchError as ShapeMismatchError

# A message and its wait live in comm_messages, the checked calls in comm_tensors: callers know them here.
from pipeclock.comm_messages import PendingRecv as PendingRecv
from pipeclock.comm_messages import PendingSend as PendingSend
from pipeclock.comm_messages import device as device
from pipeclock.comm_messages import explain as explain
from pipeclock.comm_messages import explained as explained
from pipeclock.comm_messages import get_rank as get_rank
from pipeclock.comm_messages import irecv as irecv
from pipeclock.comm_messages import isend as isend
from pipeclock.comm_messages import timeout as timeout
from pipeclock.comm_messages import wait as wait
from pipeclock.comm_tensors import MAX_DIMS as MAX_DIMS
from pipeclock.comm_tensors import SendingTensor as SendingTensor
from pipeclock.comm_tensors import decode_meta as decode_meta
from pipeclock.comm_tensors import irecv_meta as irecv_meta
from pipeclock.comm_tensors import isend_tensor as isend_tensor
from pipeclock.comm_tensors import recv_meta as recv_meta
from pipeclock.comm_tensors import recv_tensor as recv_tensor
from pipeclock.comm_tensors import send_meta as send_meta
from pipeclock.comm_tensors import send_tensor as send_tensor

# --- joining and leaving -----------------------------------------------------------------------------


def init(backend: str | None = None, timeout: float = 60.0) -> tuple[int, int]:
    """Join the process group (torchrun's environment, or a one-process world) and return (rank, world).

    ``backend`` defaults to nccl when CUDA is available and gloo otherwise. ``timeout`` (seconds) bounds
    every later blocking call made through this module. On CPU the intra-op threads are set to the cores
    divided by the local ranks, so processes on one machine do not fight over the same cores.
    """
    comm_messages.set_timeout(timeout)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    limit = datetime.timedelta(seconds=timeout)
    comm_blame.start_group()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            check_gpus(int(os.environ["RANK"]), local_ranks, torch.cuda.device_count())
            torch.cuda.set_device(comm_messages.local_rank())
        try:
            dist.init_process_group(backend, timeout=limit)
        except dist.DistError as error:  # the store's timeouts: a rank or the store never came
            raise comm_errors.not_joined(error, timeout) from None
        except RuntimeError as error:  # gloo's own: every rank came to the store, not every link formed
            if "connectFullMesh" not in str(error):
                raise
            raise comm_errors.not_connected(error, timeout) from None
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=limit)
    if backend != "nccl":
        torch.set_num_threads(threads_per_process())
    if backend == "nccl":  # one communicator per directed neighbour pair (pipeclock.comm_channels)
        comm_channels.add_channels([list(range(dist.get_world_size()))])
    return dist.get_rank(), dist.get_world_size()


def check_gpus(rank: int, local_ranks: int, gpus: int) -> None:
    """Under nccl each rank on a machine takes a GPU of its own: ``ValueError`` before anything starts when
    the machine runs more ranks than it shows GPUs, naming both numbers and what to do."""
    if local_ranks > gpus:
        raise ValueError(
            f"rank {rank}: {local_ranks} ranks on this machine (--nproc-per-node) but {gpus} GPU(s) visible: "
            f"nccl needs a GPU per rank; start at most {gpus} rank(s) per machine, or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to run every rank on the CPU with gloo"
        )


def shutdown() -> None:
    """Leave the process group (safe to call twice, or without ``init``)."""
    comm_channels.forget()
    comm_messages.forget()
    if dist.is_initialized():
        dist.destroy_process_group()


def threads_per_process() -> int:
    """This machine's usable cores divided among the local ranks, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local_ranks))


# --- topology ----------------------------------------------------------------------------------------


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_next_rank() -> int | None:
    """The rank that receives this rank's activations, or None on the last stage."""
    rank = get_rank()
    return rank + 1 if rank + 1 < get_world_size() else None


def get_prev_rank() -> int | None:
    """The rank that sends this rank its activations, or None on the first stage."""
    rank = get_rank()
    return rank - 1 if rank > 0 else None


# --- small collectives with the same timeout ----------------------------------------------------------


def _collective(post: Callable[[], dist.Work], what: str, peer: int | None = None, group=None) -> None:
    """Start a collective and wait for it; a failure when starting it (a member already gone) is
    reported like one while waiting. ``group``: None for the whole world."""
    try:
        work = post()
    except RuntimeError as error:
        raise explain(error, what, peer, group) from error
    wait(work, what, peer, group)


def all_gather(tensor: torch.Tensor, what: str, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape everywhere; the ranks of ``group``), within the timeout."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    _collective(lambda: dist.all_gather(gathered, tensor, group=group, async_op=True), what, group=group)
    return gathered


def broadcast(
    tensor: torch.Tensor, src: int, what: str, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``src``'s ``tensor`` on every rank (of ``group``; ``src`` is a global rank), in place, in time."""
    _collective(lambda: dist.broadcast(tensor, src, group=group, async_op=True), what, src, group)
    return tensor


def all_reduce(
    tensor: torch.Tensor,
    what: str,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """The sum (or ``op``) of ``tensor`` over the ranks (of ``group``), in place, within the timeout."""
    _collective(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True), what, group=group)
    return tensor


def all_gather_object(obj: object, what: str, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's picklable ``obj`` (the ranks of ``group``), on every rank, within the timeout."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [obj]
    gathered: list[object] = [None] * size
    try:
        dist.all_gather_object(gathered, obj, group=group)
    except RuntimeError as error:
        raise explain(error, what, group=group) from error
    return gathered


def barrier(what: str = "waiting at a barrier") -> None:
    """Wait until every rank arrives, within the timeout."""
    _collective(lambda: dist.barrier(async_op=True), what, group=None)


def gather_object(obj: object, what: str, dst: int = 0) -> list[object] | None:
    """Every rank's picklable ``obj`` on rank ``dst`` (None elsewhere), within the timeout."""
    if get_world_size() == 1:
        return [obj]
    gathered: list[object] | None = [None] * get_world_size() if get_rank() == dst else None
    try:
        dist.gather_object(obj, gathered, dst=dst)
    except RuntimeError as error:
        raise explain(error, what, dst, None) from error
    return gathered
