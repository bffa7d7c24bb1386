"""Watching a hand-written pipeline loop: every ``send_tensor`` / ``isend_tensor`` / ``recv_tensor`` it makes.

The course's loops (``labs/solutions/``) and the learner's (``labs/exercises/``) talk only through
``comms``. While a `Recorder` is installed, those three functions are wrapped: each call is named (the
activation or the gradient of which micro-batch, to or from which rank), reported before it starts
waiting and after it completes, and the time spent blocked in it is added up. The lab reads that time
to measure the loop's bubble; ``pipeclock lab N --check`` reads the reports to say where a loop went
wrong, or where each rank waits when it deadlocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeclock import comms

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class Message:
    """One message of a step: ``kind`` of micro-batch ``microbatch`` leaving (or entering) virtual stage
    ``stage``; ``chunk`` is the rank's local chunk."""

    kind: str
    microbatch: int
    stage: int
    chunk: int = 0

    def __str__(self) -> str:
        if self.microbatch < 0:
            return f"one {self.kind} more than the step has"
        chunk = f", chunk {self.chunk}" if self.chunk else ""
        return f"the {self.kind} of micro-batch {self.microbatch}{chunk}"


@dataclass
class Pipe:
    """The shape of the pipeline a loop runs: ``ranks`` ranks of ``chunks`` chunks (loop placement), ``m``
    micro-batches, the micro-batches taken in rounds of ``ranks`` when there are several chunks."""

    ranks: int
    chunks: int
    m: int

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.ranks + rank

    def forward_order(self) -> list[tuple[int, int]]:
        """(micro-batch, chunk) in the order every rank runs its forwards."""
        if self.chunks == 1:
            return [(i, 0) for i in range(self.m)]
        rounds = [range(start, min(start + self.ranks, self.m)) for start in range(0, self.m, self.ranks)]
        return [(i, c) for r in rounds for c in range(self.chunks) for i in r]

    def backward_order(self) -> list[tuple[int, int]]:
        if self.chunks == 1:
            return self.forward_order()
        rounds = [range(start, min(start + self.ranks, self.m)) for start in range(0, self.m, self.ranks)]
        return [(i, c) for r in rounds for c in reversed(range(self.chunks)) for i in r]

    def messages(self, rank: int, kind: str, sent: bool) -> list[Message]:
        """The messages of ``kind`` that ``rank`` sends (or receives), in the order it should."""
        last = self.ranks * self.chunks - 1
        order = self.forward_order() if kind == ACTIVATION else self.backward_order()
        found = []
        for i, c in order:
            stage = self.stage(rank, c)
            crosses = (stage < last) if (kind == ACTIVATION) == sent else (stage > 0)
            if crosses:
                found.append(Message(kind, i, stage, c))
        return found


@dataclass
class Recorder:
    """Wraps ``comms``' three point-to-point calls while installed; names each message by its place in the
    order ``pipe`` prescribes (the k-th activation a rank sends is its k-th forward's output).

    ``on_wait(text)`` is called before a call blocks, ``on_done(text)`` after it returns,
    ``on_send(message, tensor)`` with every tensor sent, and ``on_message(event, peer, tag, message)`` as
    a send is posted ("send"), a receive starts to wait ("recv") and completes ("received").
    """

    rank: int
    pipe: Pipe
    on_wait: Callable[[str], None] = lambda text: None
    on_done: Callable[[str], None] = lambda text: None
    on_send: Callable[[Message, torch.Tensor], None] = lambda message, tensor: None
    on_message: Callable[[str, int, int, Message], None] = lambda event, peer, tag, message: None
    blocked: float = 0.0  # seconds spent inside the calls
    counts: dict[tuple[str, bool], int] = field(default_factory=dict)
    unwaited: list[str] = field(default_factory=list)  # sends posted and not yet waited for, said
    asked: tuple[Message, tuple] | None = None  # the receive under way: its message, the shape asked
    _originals: dict[str, Callable] = field(default_factory=dict)

    def install(self) -> Recorder:
        self._originals = {
            name: getattr(comms, name) for name in ("send_tensor", "isend_tensor", "recv_tensor")
        }
        comms.send_tensor, comms.isend_tensor, comms.recv_tensor = (
            self.send_tensor,
            self.isend_tensor,
            self.recv_tensor,
        )
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(comms, name, original)

    def __enter__(self) -> Recorder:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def restart(self, pipe: Pipe) -> None:
        """A new step: count the messages from the start again."""
        self.pipe, self.blocked, self.counts, self.unwaited = pipe, 0.0, {}, []

    # --- the wrapped calls ---------------------------------------------------------------------------

    def send_tensor(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> None:
        message = self._next(self._kind(dest, tag, sent=True), sent=True)
        self.on_message("send", dest, tag, message)
        self.on_send(message, tensor)
        self._timed(
            f"to send {message} to rank {dest}",
            f"sent {message} to rank {dest}",
            lambda: self._originals["send_tensor"](tensor, dest, tag),
        )

    def isend_tensor(self, tensor: torch.Tensor, dest: int, tag: int = 0):
        message = self._next(self._kind(dest, tag, sent=True), sent=True)
        self.on_message("send", dest, tag, message)
        self.on_send(message, tensor)
        sending = self._originals["isend_tensor"](tensor, dest, tag)
        posted = f"{message} to rank {dest}"
        self.on_done(f"posted {posted}")
        self.unwaited.append(posted)
        recorder = self

        class Sending:
            def wait(self) -> None:
                if posted in recorder.unwaited:
                    recorder.unwaited.remove(posted)
                recorder._timed(
                    f"for rank {dest} to take {message}", f"rank {dest} took {message}", sending.wait
                )

        return Sending()

    def recv_tensor(self, shape, src: int, dtype=torch.float32, tag: int = 0) -> torch.Tensor:
        message = self._next(self._kind(src, tag, sent=False), sent=False)
        on = f" on tag {tag}" if tag else ""
        self.on_message("recv", src, tag, message)
        self.asked = (message, tuple(shape) if shape is not None else None)
        received = self._timed(
            f"for {message} from rank {src}{on}",
            f"received {message} from rank {src}",
            lambda: self._originals["recv_tensor"](shape, src, dtype, tag),
        )
        self.on_message("received", src, tag, message)
        self.asked = None
        return received

    # --- naming and timing ---------------------------------------------------------------------------

    def _kind(self, peer: int, tag: int, sent: bool) -> str:
        """Activations go down the pipeline and gradients up; round a ring (several chunks) the tag says
        which (the course's loops send gradients with tag 1)."""
        if self.pipe.chunks > 1:
            return GRADIENT if tag == 1 else ACTIVATION
        downstream = peer > self.rank
        return ACTIVATION if downstream == sent else GRADIENT

    def _next(self, kind: str, sent: bool) -> Message:
        count = self.counts.get((kind, sent), 0)
        self.counts[kind, sent] = count + 1
        expected = self.pipe.messages(self.rank, kind, sent)
        if count < len(expected):
            return expected[count]
        return Message(kind, -1, -1)  # one more than the step has: named as such by the checker

    def _timed(self, waiting: str, done: str, call: Callable):
        self.on_wait(waiting)
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.blocked += time.perf_counter() - start
            self.on_done(done)
