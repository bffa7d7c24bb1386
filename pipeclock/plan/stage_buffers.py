"""What torch's pipeline stages of December 2024 hold on one rank, action by action (``Software.pipelining``
"torch-2024": torch.distributed.pipelining with FSDP2, as torchtitan ran them), where `cluster_memory`
counts everything at its most at once:

- **the stages' buffers**: a ``PipelineStage`` kept every micro-batch's output in ``output_chunks`` until
  the next step (torch/distributed/pipelining/stage.py before pytorch/pytorch#153383, 2025-05-13, which
  keeps only the last stage's), the last stage's logits too (kept to be returned; #138504, 2024-10-21,
  detaches them, and #159251 of 2025-07 asks to stop keeping them), and allocated one activation receive
  buffer (stages after the first) and one gradient receive buffer (stages before the last) per
  micro-batch, once (``_prepare_forward_infra``, ``_prepare_backward_infra``);
- **when the gradients appear**: torchtitan zeroes them (``optimizers.zero_grad()``, to None) before each
  step, and FSDP2 with gradient sync off (torch's pipelining turns it off until a stage's last backward)
  allocates a stage's unsharded fp32 gradients at its first backward (``to_accumulated_grad_if_needed``
  in ``_fsdp_param.py``). A rank holding two stages (interleaved 1F1B) holds the second's only from its
  first backward on, after the activations have begun to go.

`most_held` walks one rank's own order of actions and takes the most it holds after any of them.
pipeclock's own stages keep a micro-batch's output with its input only until its backward and post the
next receive a tick ahead (`pipeclock.engine.step_run`, `pipeclock.engine.messenger`): what the
planner's count already says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeclock.engine.actions import BACKWARDS, Action


@dataclass(frozen=True)
class Held:
    """What one rank holds at one moment of its step, bytes, by part."""

    activations: float  # the micro-batches in flight: what each keeps for its backward
    outputs: float  # the stages' outputs kept to the step's end (the last stage's logits)
    receives: float  # the receive buffers, one a micro-batch and stage
    gradients: float  # the gradients of the stages whose backward has begun

    @property
    def total(self) -> float:
        return self.activations + self.outputs + self.receives + self.gradients


def most_held(
    actions: Sequence[Action],
    stages: Sequence[int],
    last: int,
    microbatches: int,
    kept: dict[int, float],
    logits: float,
    message: float,
    gradients: Callable[[frozenset[int]], float],
    late_gradients: bool,
) -> Held:
    """The most one rank holds after any of its ``actions``: ``stages[chunk]`` is its chunk's virtual
    stage (0 the first, ``last`` the pipeline's last, whose output is the ``logits``), ``kept[stage]``
    what a micro-batch keeps on a stage from its F to its last backward action, ``message`` one
    activation (or its gradient) between stages, ``gradients(stages)`` those stages' gradients, held
    from each one's first backward (``late_gradients``: FSDP2's) or from the step's start."""
    final = {(a.microbatch, a.chunk): i for i, a in enumerate(actions) if a.op in ("B", "W")}
    live, done = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
    started = frozenset() if late_gradients else frozenset(stages)
    grads = gradients(started)
    gradient_buffers = sum(microbatches * message for s in stages if s != last)
    most = Held(0.0, 0.0, 0.0, 0.0)
    for index, action in enumerate(actions):
        stage = stages[action.chunk]
        if action.op == "F":
            live[stage] += 1
            done[stage] += 1
        elif action.op in BACKWARDS and stage not in started:
            started |= {stage}
            grads = gradients(started)
        now = Held(
            sum(live[s] * kept[s] for s in stages),
            sum(done[s] * (logits if s == last else message) for s in stages),
            # the live micro-batches' activation buffers are their stages' inputs, counted in ``kept``
            gradient_buffers + sum((microbatches - live[s]) * message for s in stages if s != 0),
            grads,
        )
        if now.total > most.total:
            most = now
        if final.get((action.microbatch, action.chunk)) == index:
            live[stage] -= 1
    return most
