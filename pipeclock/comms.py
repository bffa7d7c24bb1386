"""The glue: joining the process group, who is next in line, and moving tensors between ranks.

``init`` is "dialling in to the conference call": it reads the environment torchrun sets (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), picks nccl on CUDA and gloo on the CPU, and remembers a timeout
that every later blocking call here honours. Without torchrun it makes a one-process world, so the same
script runs on a laptop.

Two kinds of point-to-point call live here:

- ``send_tensor`` / ``recv_tensor`` are blocking and *checked*: a small header (dtype and shape) travels
  ahead of the data, so a receiver that expected another shape gets a clear error naming both ranks and
  both shapes instead of gloo aborting the process. With ``shape=None`` the receiver learns the shape.
- ``isend`` / ``irecv`` (and ``send_meta`` / ``recv_meta`` for a one-off header) are non-blocking and
  unchecked: the orchestrator's hot path, where shapes are agreed once and cached.

Every failure is a ``CommError`` whose message names this rank, the peer and the cause: a timeout
(``CommTimeoutError``), a peer that died (``PeerGoneError``) or a mismatch (``ShapeMismatchError``).
Those words are ``pipeclock.comm_errors``; this module waits, and hands them what it waited on.
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

# The failure vocabulary lives in comm_errors; callers know it as comms.CommError, comms.PeerGoneError, ...
from pipeclock.comm_errors import CommError as CommError
from pipeclock.comm_errors import CommTimeoutError as CommTimeoutError
from pipeclock.comm_errors import PeerGoneError as PeerGoneError
from pipeclock.comm_errors import ShapeMismatchError as ShapeMismatchError

MAX_DIMS = 8
_HEADER_LEN = 2 + MAX_DIMS  # dtype code, number of dims, the dims (zero-padded)
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)

_timeout: float = 60.0
# Looked up once per process, not once per message: the hot path sends thousands of messages a second.
_rank: int | None = None
_device: torch.device | None = None


# --- joining and leaving -----------------------------------------------------------------------------


def init(backend: str | None = None, timeout: float = 60.0) -> tuple[int, int]:
    """Join the process group (torchrun's environment, or a one-process world) and return (rank, world).

    ``backend`` defaults to nccl when CUDA is available and gloo otherwise. ``timeout`` (seconds) bounds
    every later blocking call made through this module. On CPU the intra-op threads are set to the cores
    divided by the local ranks, so processes on one machine do not fight over the same cores.
    """
    global _timeout
    _timeout = float(timeout)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    limit = datetime.timedelta(seconds=timeout)
    comm_blame.start_group()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            check_gpus(int(os.environ["RANK"]), local_ranks, torch.cuda.device_count())
            torch.cuda.set_device(_local_rank())
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
    global _rank, _device
    comm_channels.forget()
    _rank = _device = None
    if dist.is_initialized():
        dist.destroy_process_group()


def threads_per_process() -> int:
    """This machine's usable cores divided among the local ranks, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local_ranks))


def device() -> torch.device:
    """Where this rank computes: its own GPU under nccl, else the CPU."""
    global _device
    if _device is None or not dist.is_initialized():
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        _device = torch.device("cuda", _local_rank()) if nccl else torch.device("cpu")
    return _device


def timeout() -> float:
    """The timeout (seconds) that bounds every blocking call."""
    return _timeout


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


# --- topology ----------------------------------------------------------------------------------------


def get_rank() -> int:
    global _rank
    if not dist.is_initialized():
        return 0
    if _rank is None:
        _rank = dist.get_rank()
    return _rank


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


def _collective(post: Callable[[], dist.Work], what: str, peer: int | None = None, group=_ANYONE) -> None:
    """Start a collective and wait for it; a failure when starting it (a member already gone) is
    reported like one while waiting."""
    try:
        work = post()
    except RuntimeError as error:
        raise explain(error, what, peer, group) from error
    wait(work, what, peer, group)


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


# --- headers: telling a receiver what is coming -------------------------------------------------------


def send_meta(tensor: torch.Tensor, dest: int, tag: int = 0) -> PendingSend:
    """Start sending ``tensor``'s dtype and shape (not its data) to ``dest``."""
    return isend(_header(tensor), dest, tag, "sending a tensor's shape")


def recv_meta(src: int, tag: int = 0) -> tuple[tuple[int, ...], torch.dtype]:
    """Receive the (shape, dtype) that ``send_meta`` sent."""
    return decode_meta(irecv_meta(src, tag).wait(), src)


def irecv_meta(src: int, tag: int = 0, what: str | None = None) -> PendingRecv:
    """Start receiving a header; ``decode_meta`` turns the received tensor into (shape, dtype)."""
    return irecv((_HEADER_LEN,), src, torch.int64, tag, what or "receiving a tensor's shape")


def decode_meta(header: torch.Tensor, src: int) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    code, ndim, dims = values[0], values[1], values[2:]
    if not 0 <= code < len(_DTYPES) or not 0 <= ndim <= MAX_DIMS:
        raise CommError(f"rank {get_rank()}: malformed header from rank {src}: {values}")
    return tuple(dims[:ndim]), _DTYPES[code]


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"rank {get_rank()}: tensors of more than {MAX_DIMS} dims cannot be sent")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"rank {get_rank()}: dtype {tensor.dtype} cannot be sent; use one of {_DTYPES}")
    dims = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor(
        [_DTYPES.index(tensor.dtype), tensor.dim(), *dims], dtype=torch.int64, device=device()
    )


# --- checked blocking point-to-point (the labs' and the user's API) -----------------------------------


def send_tensor(tensor: torch.Tensor, dest: int, tag: int = 0) -> None:
    """Send ``tensor`` to ``dest`` and wait until it has left: header first, then the data."""
    header = send_meta(tensor, dest, tag)
    data = isend(tensor, dest, tag)
    header.wait()
    data.wait()


@dataclass
class SendingTensor:
    """A ``send_tensor`` under way: its header and its data, both posted; ``wait`` until they left."""

    header: PendingSend
    data: PendingSend

    def wait(self) -> None:
        self.header.wait()
        self.data.wait()


def isend_tensor(tensor: torch.Tensor, dest: int, tag: int = 0) -> SendingTensor:
    """``send_tensor`` without the wait: post the header and the data and return at once.

    A blocking send waits for the receiver to take the tensor; two ranks that send to each other at the
    same moment would wait forever. A rank that posts its sends and waits for them later cannot.
    """
    return SendingTensor(send_meta(tensor, dest, tag), isend(tensor, dest, tag))


def recv_tensor(
    shape: tuple[int, ...] | torch.Size | None,
    src: int,
    dtype: torch.dtype | None = torch.float32,
    tag: int = 0,
) -> torch.Tensor:
    """Receive a tensor from ``src``, checking that it has ``shape`` and ``dtype``.

    ``shape=None`` (or ``dtype=None``) accepts whatever the sender sent. On a mismatch the data is still
    received (so the channel stays in step) and ``ShapeMismatchError`` names both ranks and both shapes.
    """
    sent_shape, sent_dtype = recv_meta(src, tag)
    received = irecv(sent_shape, src, sent_dtype, tag).wait()
    wanted_shape = tuple(shape) if shape is not None else sent_shape
    wanted_dtype = dtype or sent_dtype
    if (wanted_shape, wanted_dtype) != (sent_shape, sent_dtype):
        raise ShapeMismatchError(
            f"rank {get_rank()} expected {_describe(wanted_shape, wanted_dtype)} from rank {src}, "
            f"but rank {src} sent {_describe(sent_shape, sent_dtype)}"
        )
    return received


def _describe(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"shape {tuple(shape)} {str(dtype).removeprefix('torch.')}"


# --- small collectives with the same timeout ----------------------------------------------------------


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
