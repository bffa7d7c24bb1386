"""Data-parallel replicas of a pipeline, kept in step by PyTorch's own engines: FSDP2 or DDP.

Each replica runs the whole schedule on its shard of the global batch; a chunk's gradients are summed
across replicas once per step, right after that chunk's last backward (``W`` in split schedules), not
after every micro-batch. Both engines are told to *sum* (not average): every replica's loss is already
weighted by its share of the global batch (``pipeclock.engine.losses``), so the sum is the one-device
gradient even when the shards differ in size or in counted tokens.

FSDP2 (``fully_shard`` on the dp sub-mesh) is the default: parameters, gradients and optimizer state are
sharded across replicas, and gathered for the step. Its gradient hooks fire on a module's *input*
gradient, which in a split backward arrives before the weights' (``W``): so every backward runs with
sync off, and the chunk's reduce-scatter is started by hand after its last ``W``, as torch's own
pipelining does.

DDP keeps full copies. Its hooks fire as autograd accumulates each ``.grad``, within one backward call,
and it decides to sync at the *forward*: with all forwards before the backwards (GPipe), ``no_sync``
alone would sync on the wrong backward. So forwards run unsynced, and DDP is told just before a chunk's
last backward which outputs it starts from. Because the engine's ``W`` writes ``.grad`` itself, outside
autograd, a DDP pipeline runs each backward whole (``W`` does nothing).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from pipeclock import comms
from pipeclock.engine.replicas import SinglePipeline
from pipeclock.engine.ties import tie, tie_key

DATA_PARALLEL = ("fsdp", "ddp")
_REFUSED = -1  # a replica's shard size when its batch was refused: the others raise too


class _Replicas(SinglePipeline):
    """What both engines share: the dp group, and sums over it (steps that need nothing do nothing)."""

    def __init__(self, chunks: Sequence[nn.Module], mesh: DeviceMesh):
        self.mesh = mesh["dp"]
        self.group = self.mesh.get_group()
        self.size = self.mesh.size()
        self.modules = list(chunks)  # the chunks as built: what checkpoints save and optimizers update
        self.chunks: list[nn.Module] = list(chunks)  # what the pipeline runs
        self.sync_times: list[tuple[float, float]] = []  # sums the engine ran inside a backward

    def total(self, value: torch.Tensor, what: str) -> torch.Tensor:
        if self.size == 1:
            return value
        return comms.all_reduce(value, what, self.group)

    def first_sample(self, batch_size: int) -> int:
        """Where this replica's shard starts in the global batch: the shards before it, summed.

        Each replica writes its size into a slot of its own and one all-reduce sums the slots: on gloo
        that costs a third of the CPU of an all-gather of the same numbers, once per step.
        """
        if self.size == 1:
            return 0
        index = self.mesh.get_local_rank()
        sizes = torch.zeros(self.size, dtype=torch.int64, device=comms.device())
        sizes[index] = batch_size
        comms.all_reduce(sizes, "agreeing on the replicas' shards of the batch", self.group)
        refused = [str(replica) for replica, size in enumerate(sizes.tolist()) if size == _REFUSED]
        if refused and batch_size != _REFUSED:
            raise ValueError(
                f"rank {comms.get_rank()}: data-parallel replica {', '.join(refused)} refused its batch "
                "(its ranks' own errors say why)"
            )
        return int(sizes[:index].sum())

    def refuse_batch(self) -> None:
        if self.size > 1:
            self.first_sample(_REFUSED)


class FullyShardedReplicas(_Replicas):
    """FSDP2: each chunk one ``fully_shard`` unit over the dp sub-mesh, summed by reduce-scatter."""

    split_backward = True
    shards_gradients = True

    def __init__(self, chunks: Sequence[nn.Module], mesh: DeviceMesh, ignored: set | None = None):
        super().__init__(chunks, mesh)
        for chunk in self.chunks:
            ties = {name: tie_key(p) for name, p in chunk.named_parameters() if tie_key(p) is not None}
            # Gathered once per step, not once per micro-batch: a pipeline runs each chunk m times.
            fully_shard(chunk, mesh=self.mesh, reshard_after_forward=False, ignored_params=ignored)
            for name, param in chunk.named_parameters():  # the shards are new parameters: mark them again
                if name in ties:
                    tie(param, ties[name])
            chunk.set_gradient_divide_factor(1.0)
            chunk.set_force_sum_reduction_for_comms(True)  # a plain sum, which gloo also has

    def begin_step(self) -> None:
        for chunk in self.chunks:
            chunk.set_requires_gradient_sync(False)
            chunk.set_reshard_after_backward(False)
            chunk.set_is_last_backward(False)
        # Gathered here rather than in the first forward's hook, so that a replica that died is reported
        # as a lost peer (a CommError), not as a failure of the forward's own computation.
        with comms.explained("gathering the replicas' parameter shards"):
            for chunk in self.chunks:
                chunk.unshard()

    def after_last_backward(self, chunk: int) -> None:
        module = self.chunks[chunk]
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        module.set_is_last_backward(True)
        state = fully_shard.state(module)
        with comms.explained("summing the gradients across replicas"):
            for each in state._state_ctx.all_states:  # the hooks autograd did not call at the right time
                for param_group in _param_groups(each):
                    param_group.post_backward()
            state._root_post_backward_final_callback()  # waits for the reduce-scatter; reshards

    def end_evaluation(self) -> None:
        for chunk in self.chunks:  # the forwards gathered the parameters; shards again, as after a step
            chunk.reshard()


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list from torch 2.12 on, one optional group before."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


class DistributedReplicas(_Replicas):
    """DDP: full copies, summed by all-reduce in DDP's buckets during the last backward."""

    split_backward = False

    def __init__(self, chunks: Sequence[nn.Module], mesh: DeviceMesh):
        super().__init__(chunks, mesh)
        self.chunks = [self._wrap(chunk) for chunk in self.chunks]

    def _wrap(self, chunk: nn.Module) -> DistributedDataParallel:
        device_ids = [comms.device()] if comms.device().type == "cuda" else None
        wrapped = DistributedDataParallel(
            chunk, device_ids=device_ids, process_group=self.group, **_NO_BUFFER_SYNC_PER_FORWARD
        )
        wrapped.register_comm_hook(self, _sum_bucket)
        wrapped.require_backward_grad_sync = False  # forwards never prepare a sync (see the module doc)
        return wrapped

    def before_last_backward(self, chunk: int, roots: list[torch.Tensor]) -> None:
        self.chunks[chunk].reducer.prepare_for_backward(roots)

    def take_sync_times(self) -> list[tuple[float, float]]:
        times, self.sync_times = self.sync_times, []
        return times


# The buffers (a GPT's rotary tables) are equal on every replica: no broadcast before each forward.
# torch 2.13 names that forward_sync_buffers, and warns about the older broadcast_buffers.
_NO_BUFFER_SYNC_PER_FORWARD = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def _sum_bucket(replicas, bucket):  # no annotations: DDP checks them at run time, and they are strings here
    """DDP's all-reduce without its division by the number of replicas (the losses are weighted).

    Each bucket's sum runs while the backward goes on; its start and end are kept for the timeline.
    """
    start = time.perf_counter()
    work = dist.all_reduce(bucket.buffer(), group=replicas.group, async_op=True)

    def finished(done: torch.futures.Future) -> torch.Tensor:
        replicas.sync_times.append((start, time.perf_counter()))
        return done.value()[0]

    return work.get_future().then(finished)


def data_parallel(
    chunks: Sequence[nn.Module], mesh: DeviceMesh, engine: str = "fsdp", ignored: set | None = None
) -> _Replicas:
    """Make this rank's chunks one replica among the mesh's dp replicas; every rank calls it, together.

    Give ``.chunks`` and the returned object to ``Pipeline(..., replicas=...)``; ``.modules`` are the
    chunks as built (what to checkpoint). Build the optimizer after this call: FSDP2 replaces each
    parameter by its shard. Chunks split by tensor parallel (``tensor_parallel``, called first) take
    FSDP2 only: it shards the tp shards over the replicas, a 2D layout; DDP refuses DTensors.
    ``ignored``: parameters FSDP2 leaves alone (expert blocks, which ``parallel.experts`` sums itself).
    """
    if engine not in DATA_PARALLEL:
        raise ValueError(f"rank {comms.get_rank()}: unknown data-parallel engine {engine!r}: use fsdp or ddp")
    if engine == "ddp" and any(isinstance(p, DTensor) for chunk in chunks for p in chunk.parameters()):
        raise ValueError(
            f"rank {comms.get_rank()}: DDP cannot hold tensor-parallel parameters (torch has no DTensor "
            "rule for the broadcast DDP starts with): use --data-parallel fsdp with --tp"
        )
    _own_parameters(chunks)
    if engine == "fsdp":
        return FullyShardedReplicas(chunks, mesh, ignored)
    if ignored:
        raise ValueError(
            f"rank {comms.get_rank()}: --data-parallel ddp cannot leave the experts out: use fsdp with --ep"
        )
    return DistributedReplicas(chunks, mesh)


def _own_parameters(chunks: Sequence[nn.Module]) -> None:
    """A parameter shared by two chunks (a tie, both ends on one rank) becomes one copy per chunk.

    Each chunk is its own FSDP2 or DDP unit and must own its parameters: shared, the tensor would be
    summed across replicas twice. Copies keep their tie mark, so the pipeline sums their gradients.
    """
    owned_by_earlier: set[int] = set()
    for chunk in chunks:
        mine: set[int] = set()
        for module in chunk.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) in owned_by_earlier:
                    copy = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                    key = tie_key(param)
                    setattr(module, name, tie(copy, key) if key is not None else copy)
                    param = copy
                mine.add(id(param))
        owned_by_earlier |= mine


def is_fully_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)
