"""Communication derived from the actions: what a rank sends and receives, and to and from whom.

Nobody writes messages per schedule. The data flow of ``pipeclock.engine.actions`` fixes them:

- after ``F`` of virtual stage s, its output goes to the owner of stage s + 1;
- after ``B`` of stage s, the gradient of its input goes to the owner of stage s - 1;
- so ``F`` of stage s receives an activation, and ``B`` of stage s a gradient (unless s is an end).

Each message has its own tag (kind, stage, micro-batch), so on gloo arrival order does not matter and
receives can be posted early (``expect_*``) to overlap the transfer with computation. Sends never
block the sender; they are waited for in ``finish``. When both stages live on this rank (one rank with
several chunks) the tensor is handed over in memory.

A receiver cannot know the shape of an activation it has never seen (widths change between stages), so
the first activation of each (stage, micro-batch size) is preceded by a small header, and the shape is
cached on both sides. Gradients need no header: they have the shape of the output they belong to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeclock import comms
from pipeclock.engine.actions import owner

ACTIVATION, GRADIENT, HEADER = 0, 1, 2
_KIND_NAMES = {ACTIVATION: "activation", GRADIENT: "gradient", HEADER: "shape header"}
MAX_STAGES = 1024
MAX_MICROBATCHES = 65536


def message_tag(kind: int, stage: int, microbatch: int) -> int:
    """A tag unique to one message of one step (below 2**31, as gloo requires)."""
    return (kind * MAX_STAGES + stage) * MAX_MICROBATCHES + microbatch


@dataclass
class _Incoming:
    """A posted receive: the data itself, or first the header that gives the data's shape."""

    pending: comms.PendingRecv
    is_header: bool


class Messenger:
    """This rank's messages for one pipeline: sends in flight, receives posted, shapes learned."""

    def __init__(self, rank: int, num_stages: int, num_virtual: int):
        if num_virtual > MAX_STAGES:
            raise ValueError(f"rank {rank}: at most {MAX_STAGES} virtual stages, got {num_virtual}")
        self.rank, self.num_stages, self.num_virtual = rank, num_stages, num_virtual
        self._shapes: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self._announced: set[tuple[int, int]] = set()
        self._header_carrier: dict[tuple[int, int], int] = {}  # (stage, size) -> micro-batch with the header
        self._incoming: dict[tuple[int, int, int], _Incoming] = {}
        self._local: dict[tuple[int, int, int], torch.Tensor] = {}
        self._sends: list[comms.PendingSend] = []
        self.wait_seconds = 0.0  # time spent blocked on receives; the caller reads and resets it

    def _rank_of(self, stage: int) -> int:
        return owner(stage, self.num_stages)[0]

    # --- sending ---------------------------------------------------------------------------------------

    def send_activation(self, stage: int, microbatch: int, size: int, output: torch.Tensor) -> None:
        """Stage ``stage``'s output for micro-batch ``microbatch`` (of ``size`` samples) goes to stage + 1."""
        target = stage + 1
        dest = self._rank_of(target)
        if dest == self.rank:
            self._local[(ACTIVATION, target, microbatch)] = output.detach()
            return
        if (target, size) not in self._announced:
            self._announced.add((target, size))
            self._sends.append(comms.send_meta(output, dest, message_tag(HEADER, target, microbatch)))
        what = f"sending the activation of micro-batch {microbatch} for stage {target}"
        self._sends.append(comms.isend(output, dest, message_tag(ACTIVATION, target, microbatch), what))
        self._forget_finished_sends()

    def send_gradient(self, stage: int, microbatch: int, grad: torch.Tensor) -> None:
        """The gradient of stage ``stage``'s input goes back to stage - 1."""
        target = stage - 1
        dest = self._rank_of(target)
        if dest == self.rank:
            self._local[(GRADIENT, target, microbatch)] = grad
            return
        what = f"sending the gradient of micro-batch {microbatch} for stage {target}"
        self._sends.append(comms.isend(grad, dest, message_tag(GRADIENT, target, microbatch), what))
        self._forget_finished_sends()

    def _forget_finished_sends(self) -> None:
        self._sends = [send for send in self._sends if not send.done()]

    # --- receiving -------------------------------------------------------------------------------------

    def expect_activation(self, stage: int, microbatch: int, size: int) -> None:
        """Post the receive of stage ``stage``'s input now, so it can arrive while we compute."""
        key = (ACTIVATION, stage, microbatch)
        src = self._rank_of(stage - 1)
        if src == self.rank or key in self._incoming:
            return
        shape = self._shapes.get((stage, size))
        if shape is not None:
            self._incoming[key] = _Incoming(self._post_data(key, src, *shape), is_header=False)
        elif self._header_carrier.setdefault((stage, size), microbatch) == microbatch:
            header = comms.irecv_meta(src, message_tag(HEADER, stage, microbatch), self._what(key))
            self._incoming[key] = _Incoming(header, is_header=True)
        # else: an earlier micro-batch of this size brings the header; this receive is posted once the
        # shape is known (schedules send and receive each stage's micro-batches in the same order).

    def expect_gradient(self, stage: int, microbatch: int, like: torch.Tensor) -> None:
        """Post the receive of the gradient of stage ``stage``'s output (shaped ``like`` that output)."""
        key = (GRADIENT, stage, microbatch)
        src = self._rank_of(stage + 1)
        if src == self.rank or key in self._incoming:
            return
        self._incoming[key] = _Incoming(self._post_data(key, src, tuple(like.shape), like.dtype), False)

    def receive_activation(self, stage: int, microbatch: int, size: int) -> torch.Tensor:
        self.expect_activation(stage, microbatch, size)
        return self._take((ACTIVATION, stage, microbatch), size)

    def receive_gradient(self, stage: int, microbatch: int, like: torch.Tensor) -> torch.Tensor:
        self.expect_gradient(stage, microbatch, like)
        return self._take((GRADIENT, stage, microbatch), None)

    def _take(self, key: tuple[int, int, int], size: int | None) -> torch.Tensor:
        if key in self._local:
            return self._local.pop(key)
        incoming = self._incoming.pop(key)
        start = time.perf_counter()
        try:
            if incoming.is_header:
                shape, dtype = comms.decode_meta(incoming.pending.wait(), incoming.pending.src)
                self._shapes[(key[1], size)] = (shape, dtype)
                del self._header_carrier[(key[1], size)]
                incoming = _Incoming(self._post_data(key, incoming.pending.src, shape, dtype), False)
            return incoming.pending.wait()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _post_data(self, key, src: int, shape: tuple[int, ...], dtype: torch.dtype) -> comms.PendingRecv:
        return comms.irecv(shape, src, dtype, message_tag(*key), self._what(key))

    @staticmethod
    def _what(key: tuple[int, int, int]) -> str:
        kind, stage, microbatch = key
        return f"receiving the {_KIND_NAMES[kind]} of micro-batch {microbatch} for stage {stage}"

    # --- the end of a step -----------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for every send of this step; nothing may be left half-received."""
        sends, self._sends = self._sends, []
        for send in sends:
            send.wait()
        leftover = sorted(self._incoming) + sorted(self._local)
        if leftover:
            self._incoming.clear()
            self._local.clear()
            raise RuntimeError(f"rank {self.rank}: messages posted but never used this step: {leftover}")
