"""One layer's measured costs (``plan.profile`` measures them): what the planner sums into stages, in a
module without torch, so that a plan from a model's size alone (``pipeclock plan --params``, ``--cluster``)
starts without torch's import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LayerCost:
    """One layer's costs for a micro-batch of ``samples`` samples (times in seconds, sizes in bytes).

    The byte counts follow the activation meter's rule (each distinct non-parameter tensor once) and are
    split so that a stage's total can be assembled from its layers: ``held`` is what the layer saves
    apart from its input and output; ``keeps_input`` and ``keeps_output`` say how much of those it saves
    too; ``input_bytes`` are all its input's tensors (a stage stashes its input) and ``output_bytes``
    the tensors it creates (``message_bytes``: all it hands on, pass-through tensors included).
    """

    name: str
    kind: str
    samples: int
    parameters: int
    forward: float
    backward: float  # the whole backward as the engine runs it unsplit
    input_grad: float  # I: the input's gradient only
    weight_grad: float  # W: the weights' gradients, after I
    held: int
    keeps_input: int
    keeps_output: int
    input_bytes: int
    output_bytes: int
    message_bytes: int
    weight_held: int  # what W keeps alive between I and W
    workspace: int  # the most memory its F and B need beyond what they keep (temporaries), measured
    loss_held: int  # what the loss keeps from F to B (the last layer only; the meter does not see it)
    unmetered: int  # what F keeps beyond ``held`` in whole storages (views, the engine's captures)
    largest_parameter: int  # bytes of its largest parameter tensor (the optimizer's temporaries)
    keeps_graph: bool  # W goes back through autograd (a module with parameters that is not a Linear)
    # the same three under ``--recompute every-K`` when this layer is one of the checkpointed blocks
    # (None: as without recompute); measured, because what stays outside the checkpoint depends on the
    # module (ShardedMLP's ReLU runs after its checkpointed Linear and still saves its output)
    checkpointed: tuple[int, int, int] | None = None  # (held, keeps_input, keeps_output)
    dtype: str = "fp32"  # the compute dtype it was measured in (``--dtype``): its sizes and times are its
    # of ``weight_held``, what the forward does not already keep (a Linear's input is both): what W adds
    # when the forward's graph stays until W (None: all of it)
    weight_extra: int | None = None
    # what W keeps when this layer is checkpointed: a module other than a Linear then keeps the input its
    # rebuild saw, to run again in W, where without recompute W goes back through the forward's graph
    weight_held_checkpointed: int | None = None
    # (tie key, numbers) of each parameter tied to another layer's (``engine.ties``): a rank holding both
    # layers holds that tensor once
    tied: tuple[tuple[str, int], ...] = ()
    # measured on a GPU: its compute capability (its cuBLAS workspace depends on it), and the bytes the
    # CUDA caching allocator adds to one copy of the layer's parameters (each tensor rounded up to 512 B)
    cuda_capability: tuple[int, int] | None = None
    parameter_slack: int = 0

    def saves(self, checkpointed: bool) -> tuple[int, int, int]:
        """(held, keeps_input, keeps_output) in the forward, with or without this layer checkpointed."""
        if checkpointed and self.checkpointed is not None:
            return self.checkpointed
        return self.held, self.keeps_input, self.keeps_output

    def scaled(self, samples: int) -> LayerCost:
        """The same layer for another micro-batch size: bytes and times in proportion to the samples.

        Times are not quite proportional (small batches pay fixed overheads): measure at the size you
        run when the figure matters.
        """
        k = samples / self.samples
        sizes = ("held", "keeps_input", "keeps_output", "input_bytes", "output_bytes", "message_bytes")
        scaled = (*sizes, "weight_held", "weight_extra", "weight_held_checkpointed", "workspace")
        scaled += ("loss_held", "unmetered")
        changed = {name: round(value * k) for name in scaled if (value := getattr(self, name)) is not None}
        times = {
            name: getattr(self, name) * k for name in ("forward", "backward", "input_grad", "weight_grad")
        }
        checkpointed = self.checkpointed and tuple(round(x * k) for x in self.checkpointed)
        return replace(self, samples=samples, checkpointed=checkpointed, **changed, **times)
