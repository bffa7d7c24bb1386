"""Checked blocking point-to-point: a small header (dtype and shape) travels ahead of each tensor.

``send_tensor`` / ``recv_tensor`` (the labs' and the user's calls, known as ``comms.send_tensor`` and
``comms.recv_tensor``) send the header first, so a receiver that expected another shape gets a clear
error naming both ranks and both shapes instead of gloo aborting the process; with ``shape=None`` the
receiver learns the shape. ``send_meta`` / ``recv_meta`` send or receive a header alone, for a one-off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeclock.comm_errors import CommError, ShapeMismatchError
from pipeclock.comm_messages import PendingRecv, PendingSend, device, get_rank, irecv, isend

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
