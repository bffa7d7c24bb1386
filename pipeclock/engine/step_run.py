"""One step (or one evaluation) on one rank: the runtime of this rank's program.

A ``Pipeline`` builds a ``StepRun`` for each ``step`` or ``evaluate``. It walks the rank's program
(``pipeclock.engine.program``) and hands each instruction to one small handler: ``SIZES`` sends this
rank's batch sizes, ``AGREE`` checks the ends' and cuts the batch, ``RECV_*`` post receives, compute
runs a chunk forward or backward (taking the data its receive brought), ``SEND_*`` send what the
compute kept, ``REDUCE_GRAD`` sums over replicas, ``SUM_TIED`` and ``LOSS`` close the step once every
send is done. It keeps each micro-batch's stash from
its ``F`` until its last backward, the loss, the measured spans, and the data-parallel sums.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from pipeclock import comms
from pipeclock.engine import faults, pytree, rng
from pipeclock.engine.action_clock import Marked, spans_of
from pipeclock.engine.actions import Action
from pipeclock.engine.backward import (
    backward_input,
    backward_weight,
    backward_whole,
    gradient_roots,
    held_tensors,
    in_place_saves_enough,
    modified_in_place,
    nothing_to_accumulate,
)
from pipeclock.engine.losses import loss_scales
from pipeclock.engine.microbatch import microbatch_sizes
from pipeclock.engine.program import Instruction
from pipeclock.engine.spans import Span


class StageError(RuntimeError):
    """A stage's own computation failed (a shape that does not fit, a bad loss ...); names rank and action."""


class BatchRefused(ValueError):
    """The batch the ends were given cannot be run (no inputs, sizes that differ ...); raised alike on
    every rank at ``AGREE``, before any activation is sent (on the first stage perhaps after its first
    forward), so it passes through as it is, not as a ``StageError``."""


@dataclass
class _Stash:
    """What a micro-batch's forward leaves for its backward on one chunk."""

    stage_input: object  # the received pytree (or the micro-batch's inputs on the first stage)
    output: object | None  # the chunk's output pytree
    root: torch.Tensor | None  # the weighted loss, on the last stage
    captured: list = field(default_factory=list)
    weight_work: list = field(default_factory=list)


class StepRun:
    """The state of one step (or one evaluation) on one rank: micro-batches, stashes, loss and spans.

    ``run`` walks this rank's program (``pipeclock.engine.program``) and hands each instruction to the
    handler of its kind; nothing here knows which schedule it runs.
    """

    def __init__(self, pipe, inputs, targets, training: bool = True):
        self.pipe, self.training = pipe, training
        self.program = pipe.programs[pipe.rank] if training else pipe.evaluation_programs[pipe.rank]
        self.given = (inputs, targets)
        self.sizes: list[int] | None = None  # the micro-batch sizes, once cut
        self.rejection: ValueError | None = None  # what this rank's own batch raised, told at AGREE
        self.clock = pipe.new_clock()  # CUDA events on a GPU: read after the step, no synchronize per action
        self.marked: list[Marked] = []
        if pipe.messenger is not None:
            pipe.messenger.clock = self.clock
        self.stash: dict[tuple[int, int], _Stash] = {}
        self.outgoing: dict[tuple[str, int, int], object] = {}  # what a SEND_F / SEND_B sends
        self.loss: torch.Tensor | None = None
        self.shared_loss = 0.0
        self.syncs: list[tuple[float, float]] = []
        self.sent_bytes = 0
        self.meter = pipe.meter
        self.handlers = {
            "SIZES": self.send_sizes,
            "AGREE": self.agree,
            "F": self.timed,
            "B": self.timed,
            "I": self.timed,
            "W": self.timed,
            "RECV_F": self.post_activation,
            "RECV_B": self.post_gradient,
            "SEND_F": self.send,
            "SEND_B": self.send,
            "UNSHARD": _nothing,  # FSDP2 gathers and frees in its own hooks
            "RESHARD": _nothing,
            "REDUCE_GRAD": self.reduce_grad,
            "SUM_TIED": self.sum_tied,
            "LOSS": self.share_loss,
        }

    def run(self) -> None:
        for instruction in self.program:
            self.handlers[instruction.kind](instruction)

    @functools.cached_property
    def spans(self) -> list[Span]:
        """The measured span of each action run, read once the step is over (the marks all at once)."""
        return spans_of(self.clock, self.pipe.global_rank, self.marked)

    # --- the step-wide words ---------------------------------------------------------------------------

    def send_sizes(self, instruction: Instruction) -> None:
        """This rank's batch sizes leave. A rank whose program agrees later (the first stage, running its
        first forward meanwhile) cuts its own batch now, or, if it cannot, agrees at once: refused."""
        pipe = self.pipe
        mine, self.rejection = pipe._send_sizes(*self.given)
        position = self.program.index(instruction)
        if self.program[position + 1].kind == "AGREE":
            return
        if self.rejection is not None or mine[0] < pipe.num_microbatches:
            self.agree(instruction)  # raises BatchRefused, on every rank alike
        pipe.messenger.new_input_shapes(mine[2])
        self._cut(microbatch_sizes(mine[0], pipe.num_microbatches))

    def agree(self, _instruction: Instruction) -> None:
        """The ends' sizes read and checked on every rank alike; the batch cut, unless it already was."""
        sizes = self.pipe._confirm_batch(self.rejection)
        if self.sizes is None:
            self._cut(sizes)

    def _cut(self, sizes: list[int]) -> None:
        """Cut this rank's part of the batch into micro-batches of ``sizes``."""
        pipe, (inputs, targets) = self.pipe, self.given
        self.sizes = sizes
        if self.training:
            pipe.replicas.begin_step()
        self.first_samples = [pipe.first_sample + sum(sizes[:mb]) for mb in range(len(sizes))]
        self.inputs = pytree.split(inputs, sizes, pipe.device) if pipe.rank == pipe.first_rank else None
        self.targets = None
        if pipe.rank == pipe.last_rank:
            self.targets = pytree.split(targets, sizes, pipe.device)
            self.scales = loss_scales(pipe.loss_fn, self.targets, sizes, pipe.global_total)
        if self.meter:
            self.meter.reset()
        pipe.messenger.sent_bytes = 0

    def _messages_done(self) -> None:
        """Before the words that end a step: every send waited for, nothing left half-received."""
        if self.pipe.messenger is not None and not getattr(self, "_finished", False):
            self._finished = True
            self.pipe.messenger.finish()
            self.sent_bytes = self.pipe.messenger.sent_bytes
            self.syncs += self.pipe.replicas.take_sync_times()

    def sum_tied(self, _instruction: Instruction) -> None:
        self._messages_done()
        self.pipe.ties.sync()

    def share_loss(self, _instruction: Instruction) -> None:
        self._messages_done()
        self.shared_loss = self.pipe._share_loss(self.loss)

    # --- messages --------------------------------------------------------------------------------------

    def post_activation(self, instruction: Instruction) -> None:
        stage, mb = instruction.stage, instruction.microbatch
        self.pipe.messenger.expect_activation(stage, mb, self.sizes[mb])

    def post_gradient(self, instruction: Instruction) -> None:
        stage, mb = instruction.stage, instruction.microbatch
        stash = self.stash.get((mb, self.pipe.placement.owner(stage)[1]))
        if stash is None:
            raise StageError(
                f"rank {self.pipe.global_rank}: {instruction} comes before the forward of micro-batch "
                f"{mb} on stage {stage}: the gradient's shape is its output's"
            )
        self.pipe.messenger.expect_gradient(stage, mb, stash.output)

    def send(self, instruction: Instruction) -> None:
        kind, stage, mb = instruction.kind, instruction.stage, instruction.microbatch
        key = (kind, stage, mb)
        if key not in self.outgoing:
            raise StageError(f"rank {self.pipe.global_rank}: {instruction} comes before the compute it sends")
        payload, action = self.outgoing.pop(key)
        self._deliver(kind, stage, mb, payload, action)
        faults.point("send", self.pipe.steps_done)

    def _hand_on(self, kind: str, stage: int, mb: int, payload, action: Action) -> None:
        """Keep what a SEND will send, or hand it over in memory to a stage on this rank."""
        target = stage + 1 if kind == "SEND_F" else stage - 1
        if self.pipe.placement.owner(target)[0] != self.pipe.rank:
            self.outgoing[(kind, stage, mb)] = (payload, action)
        else:
            self._deliver(kind, stage, mb, payload, action)

    def _deliver(self, kind: str, stage: int, mb: int, payload, action: Action) -> None:
        messenger = self.pipe.messenger
        try:
            if kind == "SEND_F":
                messenger.send_activation(stage, mb, self.sizes[mb], payload)
            else:
                messenger.send_gradient(stage, mb, payload)
        except (comms.CommError, BatchRefused):
            raise
        except Exception as error:
            raise StageError(
                f"rank {self.pipe.global_rank}: {action} (virtual stage {stage}) failed: {error}"
            ) from error

    def reduce_grad(self, instruction: Instruction) -> None:
        self.sync_replicas(self.pipe.placement.owner(instruction.stage)[1])

    # --- compute ---------------------------------------------------------------------------------------

    def timed(self, instruction: Instruction) -> None:
        self.stage = instruction.stage
        self.execute(instruction.action)

    def sync_replicas(self, chunk: int) -> None:
        """The chunk's gradients are complete: the data-parallel engine sums them across replicas."""
        start = time.perf_counter()
        self.pipe.replicas.after_last_backward(chunk)
        self.syncs.append((start, time.perf_counter()))

    def execute(self, action: Action) -> None:
        messenger = self.pipe.messenger
        messenger.waits = []
        start = self.clock.mark()
        try:
            self.run_action(action)
        except (comms.CommError, BatchRefused, StageError):
            raise
        except Exception as error:
            raise StageError(
                f"rank {self.pipe.global_rank}: {action} (virtual stage {self.stage}) failed: {error}"
                + self._input_note(action)
            ) from error
        self.marked.append(Marked(action, start, self.clock.mark(), messenger.waits))

    def run_action(self, action: Action) -> None:
        if action.op == "F":
            self.forward(action)
        elif action.op in "BI":
            self.backward(action)
        elif self.pipe.replicas.split_backward:  # else W's work was done by its I, run whole
            self.weight(action)

    def _input_note(self, action: Action) -> str:
        """For a failed forward: what the previous stage handed over, which names both stages."""
        stage = self.stage
        if action.op != "F" or stage == 0:
            return ""
        sender = self.pipe.placement.owner(stage - 1)[0]
        received = getattr(self, "_last_input", None)
        shown = pytree.describe(received) if received is not None else "nothing"
        return f"; its input came from stage {stage - 1} (rank {sender}) as {shown}"

    def forward(self, action: Action) -> None:
        pipe, stage, mb = self.pipe, self.stage, action.microbatch
        if stage == 0:
            stage_input = self.inputs[mb]
        else:
            faults.point("recv", pipe.steps_done)
            stage_input = pipe.messenger.receive_activation(stage, mb, self.sizes[mb])
            self._last_input = stage_input
            if self.training:
                for leaf in pytree.gradient_leaves(stage_input):
                    leaf.requires_grad_()
        with rng.keyed(pipe.steps_done, self.first_samples[mb]), pipe.precision.autocast(pipe.device):
            output = self._run_chunk(action.chunk, stage_input, (mb, action.chunk))
        faults.point("F", pipe.steps_done)
        if stage == pipe.num_virtual - 1:
            root = _scalar(pipe.loss_fn(pipe.precision.for_loss(output), self.targets[mb])) * self.scales[mb]
            self.loss = root.detach() if self.loss is None else self.loss + root.detach()
        else:
            root = None
            self._hand_on("SEND_F", stage, mb, output, action)
        if self.training:
            self.stash[(mb, action.chunk)] = _Stash(stage_input, output, root, self._captured)
            if self.meter:
                self.meter.hold((mb, action.chunk))

    def _run_chunk(self, chunk: int, stage_input, key: tuple[int, int]):
        """The chunk's forward; in training, its parameter outputs captured and its activations metered."""
        pipe = self.pipe
        shape = _shape(pipe.chunks[chunk], chunk, stage_input, self.training) if self.meter else None
        if not self.training:  # whatever autograd would save is metered: nothing, under no_grad
            self._captured = []
            with self.meter.measuring(key, [], shape) if self.meter else nullcontext():
                output = pipe.chunks[chunk](stage_input)
            if self.meter:
                self.meter.hold(key)
                self.meter.release(key)
            return output
        stashed: list[torch.Tensor] = pytree.leaves(stage_input)
        outputs = pipe.parameter_outputs
        fed_shape = None
        if not outputs.defers_weights:  # whether this forward's capture is used depends on its shapes
            fed_shape = shape or _shape(pipe.chunks[chunk], chunk, stage_input, self.training)
        with self.meter.measuring(key, stashed, shape) if self.meter else nullcontext():
            with outputs.capture(fed_shape, pipe.chunks[chunk]) as captured:
                fed = _copy_floats(stage_input) if pipe.copies_input[chunk] else stage_input
                output = pipe.chunks[chunk](fed)
            stashed += pytree.leaves(output)
        self._captured = outputs.kept(fed_shape, captured)
        return output

    def backward(self, action: Action) -> None:
        pipe, stage, mb = self.pipe, self.stage, action.microbatch
        key = (mb, action.chunk)
        stash = self.stash[key]
        if stage == pipe.num_virtual - 1:
            roots, grads = [stash.root], None
        else:
            received = pipe.messenger.receive_gradient(stage, mb, stash.output)
            roots, grads = gradient_roots(pytree.gradient_leaves(stash.output), received)
        inputs = [leaf for leaf in pytree.gradient_leaves(stash.stage_input) if leaf.requires_grad]
        replicas = pipe.replicas
        deferred = action.op == "I" and replicas.split_backward  # the weights' half waits for a W
        if not replicas.split_backward and pipe.last_backward[action.chunk] == action:
            replicas.before_last_backward(action.chunk, roots)
        if self._runs_whole(deferred, stash.captured):
            input_grads = backward_whole(roots, grads, inputs)  # plain autograd, same result
            self._done(*key)
        else:
            keep_graph = pipe.parameter_outputs.keeps_graph
            with pipe.parameter_outputs.rebuilding(stash.captured):
                input_grads, work = backward_input(roots, grads, inputs, stash.captured, keep_graph)
            if deferred:  # W comes later: hold only what it needs
                output, root = (stash.output, stash.root) if keep_graph else (None, None)
                self.stash[key] = _Stash(stash.stage_input, output, root, [], work)
                if self.meter:
                    self.meter.update(key, held_tensors(work), keep_graph)
            else:
                backward_weight(work)
                self._done(*key)
        faults.point(action.op, pipe.steps_done)
        if stage > 0:
            self._hand_on("SEND_B", stage, mb, input_grads, action)

    def _runs_whole(self, deferred: bool, captured: list) -> bool:
        """Whether this backward is one autograd call rather than B then W.

        Always under a data-parallel wrapper that needs autograd's own hooks (``split_backward`` false);
        never when W is deferred. A backward that W follows at once is split only where that pays
        (``backward.in_place_pays``: only Linears, wide enough; ``backward.in_place_saves_enough``: the
        micro-batch small next to the weights) and can: not when an output was changed in place (its
        gradient cannot be split off), nor when there is no gradient to add to yet
        (``backward.nothing_to_accumulate``: the split would only add Python).
        """
        if not self.pipe.replicas.split_backward:
            return True
        if deferred:
            return False
        return (
            not self.pipe.parameter_outputs.split_pays
            or not in_place_saves_enough(captured)
            or modified_in_place(captured) is not None
            or nothing_to_accumulate(captured)
        )

    def weight(self, action: Action) -> None:
        faults.point("W", self.pipe.steps_done)
        backward_weight(self.stash[(action.microbatch, action.chunk)].weight_work)
        self._done(action.microbatch, action.chunk)

    def _done(self, mb: int, chunk: int) -> None:
        del self.stash[(mb, chunk)]
        if self.meter:
            self.meter.release((mb, chunk))


def _nothing(_instruction: Instruction) -> None:
    pass


def _shape(module, chunk: int, stage_input, training: bool) -> tuple:
    """What a chunk's saved activations depend on: which chunk, in which mode, fed which shapes."""
    fed = tuple((leaf.shape, leaf.dtype, leaf.requires_grad) for leaf in pytree.leaves(stage_input))
    return chunk, training, module.training, fed


def _copy_floats(tree):
    """A copy of the floating leaves, for a chunk whose first layer works in place on its input."""
    return pytree.tree_map(lambda leaf: leaf.clone() if pytree.carries_gradient(leaf) else leaf, tree)


def _scalar(loss) -> torch.Tensor:
    """The loss function's value, if it is one number in a tensor; else say what it returned.

    A backward needs one number to start from: a per-sample loss (no reduction) would otherwise fail
    later, in the backward, with autograd's words about implicit gradients.
    """
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"the loss function returned a {type(loss).__name__}, not a tensor")
    if loss.dim() != 0:
        raise ValueError(
            f"the loss function returned a tensor of shape {tuple(loss.shape)}, not a scalar: "
            "reduce it to one number (mean, or sum with a count method)"
        )
    return loss
