"""How the program's messages travel: tags, headers, posted receives, sends let go, hand-overs.

The program (``pipeclock.engine.program``) says which message a rank sends or posts, and when; the
messenger carries them out. An activation is a pytree (``pipeclock.engine.pytree``): each leaf is one
message tagged (kind, leaf, stage, micro-batch), so on gloo arrival order does not matter. A receiver
cannot know an activation's structure and shapes before it has seen one, so the first activation of
each (stage, micro-batch size) is preceded by a header, kept on both sides until the inputs' shape key
changes; a gradient is shaped like the output it belongs to. On gloo a send holds its tensor until it
is waited for, and is done only once its receiver posted the receive: it is waited for as soon as it is
known to be taken (an activation's once its gradient came back, a gradient's once the rank it went to
sent an activation from a later forward: ``sends_done_by``), the rest in ``finish``. Two stages on one
rank hand over in memory. With a ``wire_dtype`` (bf16) floating leaves travel in it and arrive widened
back to their own dtype; a hand-over in memory is rounded alike, so the math does not depend on the
placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeclock import comms
from pipeclock.engine import pytree
from pipeclock.engine.action_clock import HostClock
from pipeclock.engine.actions import Action
from pipeclock.engine.limits import MAX_MICROBATCHES, MAX_STAGES
from pipeclock.engine.placement import Placement

ACTIVATION, GRADIENT, HEADER = 0, 1, 2
STEP = 3  # the batch size and the loss, once a step (``pipeclock.engine.step_ends``)
_KIND_NAMES = {ACTIVATION: "activation", GRADIENT: "gradient", HEADER: "structure header"}


def message_tag(kind: int, stage: int, microbatch: int, leaf: int = 0) -> int:
    """A tag unique to one message of one step (below 2**31, as gloo requires)."""
    return ((kind * pytree.MAX_LEAVES + leaf) * MAX_STAGES + stage) * MAX_MICROBATCHES + microbatch


@dataclass
class _Incoming:
    """Posted receives: the leaves of a tree (``spec`` to rebuild it), or first the header (no spec)."""

    pending: list[comms.PendingRecv | _Widened]
    spec: object | None
    is_header: bool = False


@dataclass
class _Widened:
    """A leaf posted in the wire dtype, handed over in the dtype it was sent from."""

    pending: comms.PendingRecv
    dtype: torch.dtype

    def wait(self) -> torch.Tensor:
        return self.pending.wait().to(self.dtype)


class Messenger:
    """This rank's messages for one pipeline: sends in flight, receives posted, layouts learned."""

    def __init__(
        self,
        rank: int,
        placement: Placement,
        peers: list[int] | None = None,
        wire_dtype: torch.dtype | None = None,
        table: Sequence[Sequence[Action]] = (),
    ):
        """``rank`` is this rank in the pipeline; ``peers`` the global rank of each (default: the same);
        ``wire_dtype`` the dtype floating messages travel in (default: their own); ``table`` every
        rank's actions, which tell when a gradient this rank sent has been taken."""
        if placement.num_virtual > MAX_STAGES:
            raise ValueError(f"rank {rank}: at most {MAX_STAGES} virtual stages, got {placement.num_virtual}")
        self.peers = list(range(placement.num_ranks)) if peers is None else peers
        self.rank, self.placement = self.peers[rank], placement  # global ranks from here on
        self.wire_dtype = wire_dtype
        self._layouts: dict[tuple[int, int], pytree.Layout] = {}
        self._announced: dict[tuple[int, int], list[torch.Size]] = {}  # (stage, size) -> leaf shapes sent
        self._input_shapes: int | None = None  # the step's ``pytree.shape_key`` of the inputs
        self._header_carrier: dict[tuple[int, int], int] = {}  # (stage, size) -> micro-batch with the header
        self._incoming: dict[tuple[int, int, int], _Incoming] = {}
        self._local: dict[tuple[int, int, int], object] = {}
        self._sends: dict[tuple[int, int, int], list[comms.PendingSend]] = {}  # by message key
        self._done_by = sends_done_by(table, placement, rank) if table else {}
        self.clock = HostClock()  # marks the receives' waits (``action_clock``): the caller sets it per step
        self.waits: list[tuple] = []  # (start, end) marks of each wait for a receive; the caller resets it
        self.sent_bytes = 0  # bytes sent to other ranks; the caller reads and resets it

    def _rank_of(self, stage: int) -> int:
        return self.peers[self.placement.owner(stage)[0]]

    def abandon(self) -> None:
        """Forget a step refused before any message: activations handed over within the rank."""
        self._local.clear()

    def new_input_shapes(self, key: int) -> None:
        """This step's inputs have shape key ``key`` (``pytree.shape_key``), the same on every rank: when it
        differs from the last step's, the layouts learned are forgotten and headers travel again."""
        if key != self._input_shapes:
            self._input_shapes = key
            self._announced.clear()
            self._layouts.clear()
            self._header_carrier.clear()

    # --- sending ---------------------------------------------------------------------------------------

    def send_activation(self, stage: int, microbatch: int, size: int, output: pytree.Tree) -> None:
        """Stage ``stage``'s output for micro-batch ``microbatch`` (of ``size`` samples) goes to stage + 1."""
        target = stage + 1
        dest = self._rank_of(target)
        if dest == self.rank:
            if (target, size) not in self._announced:  # checked as a message would be, once per layout
                pytree.check_tensors(output, f"the output of stage {stage}")
                self._announced[(target, size)] = [leaf.shape for leaf in pytree.leaves(output)]
            self._local[(ACTIVATION, target, microbatch)] = pytree.tree_map(self._through_wire, output)
            return
        announced = self._announced.get((target, size))
        if announced is None:
            pytree.check_tensors(output, f"the output of stage {stage}")
            self._announced[(target, size)] = [leaf.shape for leaf in pytree.leaves(output)]
            header = pytree.encode_header(output, comms.device())
            tag = message_tag(HEADER, target, microbatch)
            key = (ACTIVATION, target, microbatch)
            self._send(key, comms.isend(header, dest, tag, "sending an activation's structure"))
        elif announced != [leaf.shape for leaf in pytree.leaves(output)]:
            raise ValueError(
                f"the output of stage {stage} is {pytree.describe(output)}, but was "
                f"{[list(shape) for shape in announced]} for the same input shapes: a stage's output "
                "shapes must follow from its input's"
            )
        what = f"sending the activation of micro-batch {microbatch} for stage {target}"
        for leaf_index, leaf in enumerate(pytree.leaves(output)):
            tag = message_tag(ACTIVATION, target, microbatch, leaf_index)
            self._send((ACTIVATION, target, microbatch), comms.isend(self._to_wire(leaf), dest, tag, what))

    def send_gradient(self, stage: int, microbatch: int, grads: list[torch.Tensor]) -> None:
        """The gradients of stage ``stage``'s floating input leaves go back to stage - 1."""
        target = stage - 1
        dest = self._rank_of(target)
        if dest == self.rank:
            self._local[(GRADIENT, target, microbatch)] = [self._through_wire(grad) for grad in grads]
            return
        what = f"sending the gradient of micro-batch {microbatch} for stage {target}"
        for leaf_index, grad in enumerate(grads):
            tag = message_tag(GRADIENT, target, microbatch, leaf_index)
            self._send((GRADIENT, target, microbatch), comms.isend(self._to_wire(grad), dest, tag, what))

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype if self.wire_dtype is not None and dtype.is_floating_point else dtype

    def _to_wire(self, leaf: torch.Tensor) -> torch.Tensor:
        """What leaves for another rank. A tensor subclass (the result of a tensor-parallel all-reduce
        that may still be in flight, say) becomes a plain tensor first: a send reads raw memory, which
        only an operation on the subclass waits for."""
        if type(leaf) is not torch.Tensor:
            leaf = leaf.detach().clone()
        dtype = self._wire(leaf.dtype)
        return leaf if dtype == leaf.dtype else leaf.detach().to(dtype)

    def _through_wire(self, leaf: torch.Tensor) -> torch.Tensor:
        """What a receiver on another rank would get: rounded to the wire dtype, widened back."""
        return self._to_wire(leaf).to(leaf.dtype).detach()

    # --- receiving -------------------------------------------------------------------------------------

    def expect_activation(self, stage: int, microbatch: int, size: int) -> None:
        """Post the receive of stage ``stage``'s input now, so it can arrive while we compute."""
        key = (ACTIVATION, stage, microbatch)
        if key in self._incoming:  # posted a tick ahead: nothing more to do
            return
        src = self._rank_of(stage - 1)
        if src == self.rank:
            return
        layout = self._layouts.get((stage, size))
        if layout is not None:
            spec, shapes = layout
            self._incoming[key] = _Incoming(self._post_leaves(key, src, shapes), spec)
        elif self._header_carrier.setdefault((stage, size), microbatch) == microbatch:
            tag = message_tag(HEADER, stage, microbatch)
            header = comms.irecv((pytree.HEADER_BYTES,), src, torch.uint8, tag, self._what(key))
            self._incoming[key] = _Incoming([header], None, is_header=True)
        # else: an earlier micro-batch of this size brings the header; this receive is posted once the
        # layout is known (schedules send and receive each stage's micro-batches in the same order).

    def expect_gradient(self, stage: int, microbatch: int, like: pytree.Tree) -> None:
        """Post the receives of the gradients of stage ``stage``'s output (shaped like its float leaves)."""
        key = (GRADIENT, stage, microbatch)
        if key in self._incoming:  # posted a tick ahead: nothing more to do
            return
        src = self._rank_of(stage + 1)
        if src == self.rank:
            return
        shapes = [(tuple(leaf.shape), leaf.dtype) for leaf in pytree.gradient_leaves(like)]
        self._incoming[key] = _Incoming(self._post_leaves(key, src, shapes), None)

    def receive_activation(self, stage: int, microbatch: int, size: int) -> pytree.Tree:
        self.expect_activation(stage, microbatch, size)
        return self._take((ACTIVATION, stage, microbatch), size)

    def receive_gradient(self, stage: int, microbatch: int, like: pytree.Tree) -> list[torch.Tensor]:
        self.expect_gradient(stage, microbatch, like)
        return self._take((GRADIENT, stage, microbatch), None)

    def _take(self, key: tuple[int, int, int], size: int | None):
        if key in self._local:
            return self._local.pop(key)
        incoming = self._incoming.pop(key)
        start = self.clock.mark()
        try:
            if incoming.is_header:
                (header,) = incoming.pending
                spec, shapes = pytree.decode_header(header.wait())
                self._layouts[(key[1], size)] = (spec, shapes)
                del self._header_carrier[(key[1], size)]
                incoming = _Incoming(self._post_leaves(key, header.src, shapes), spec)
            received = [pending.wait() for pending in incoming.pending]
        finally:
            self.waits.append((start, self.clock.mark()))
        kind, stage, microbatch = key
        done = [(ACTIVATION, stage + 1, microbatch)] if kind == GRADIENT else self._done_by.get(key, ())
        for sent in done:  # their receivers have them: the waits return at once, the tensors are freed
            for send in self._sends.pop(sent, ()):
                send.wait()
        return received if incoming.spec is None else pytree.unflatten(received, incoming.spec)

    def _post_leaves(self, key, src: int, shapes) -> list[comms.PendingRecv | _Widened]:
        kind, stage, microbatch = key
        posted = []
        for leaf, (shape, dtype) in enumerate(shapes):
            tag = message_tag(kind, stage, microbatch, leaf)
            wire = self._wire(dtype)
            pending = comms.irecv(shape, src, wire, tag, self._what(key))
            posted.append(pending if wire == dtype else _Widened(pending, dtype))
        return posted

    @staticmethod
    def _what(key: tuple[int, int, int]) -> str:
        kind, stage, microbatch = key
        return f"receiving the {_KIND_NAMES[kind]} of micro-batch {microbatch} for stage {stage}"

    # --- the end of a step -----------------------------------------------------------------------------

    def _send(self, key: tuple[int, int, int], pending: comms.PendingSend) -> None:
        self._sends.setdefault(key, []).append(pending)
        self.sent_bytes += pending.tensor.numel() * pending.tensor.element_size()

    @property
    def messages_held(self) -> int:
        """Messages to other ranks whose sends still hold their tensors (not yet known done)."""
        return len(self._sends)

    def finish(self) -> None:
        """Wait for every send of this step; nothing may be left half-received."""
        sends, self._sends = self._sends, {}
        for send in (send for posted in sends.values() for send in posted):
            send.wait()
        leftover = sorted(self._incoming) + sorted(self._local)
        if leftover:
            self._incoming.clear()
            self._local.clear()
            raise RuntimeError(f"rank {self.rank}: messages posted but never used this step: {leftover}")


def sends_done_by(
    table: Sequence[Sequence[Action]], placement: Placement, rank: int
) -> dict[tuple[int, int, int], list[tuple[int, int, int]]]:
    """For each activation ``rank`` receives, the gradients it sent that are surely taken by then (those
    taken since the sender's previous forward of that stage; the earlier ones are freed before).

    The gradient of micro-batch k for stage s goes to the owner of s, which takes it in its backward of
    (s, k). An activation that owner sends later, from a forward of s that comes after that backward in
    its actions, can only arrive once the gradient was taken: its send is then done.
    """
    found: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    for stage in placement.stages[rank]:
        if stage == 0:
            continue
        sender, chunk = placement.owner(stage - 1)
        if sender == rank:
            continue
        taken = []  # the gradients the sender took since its previous forward of the stage
        for action in table[sender]:
            if action.chunk != chunk:
                continue
            if action.op in ("B", "I"):
                taken.append((GRADIENT, stage - 1, action.microbatch))
            elif action.op == "F":
                found[(ACTIVATION, stage, action.microbatch)], taken = taken, []
    return found
