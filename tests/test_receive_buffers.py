"""Receive buffers are kept and reused, and never while anything still holds what was received.

Reusing a buffer that a module, autograd or a send still reads would overwrite a tensor under its
holder's feet: a wrong gradient, silently. So the tests below hold a received tensor in every way one can
be held and check that the buffer is not handed out again, and on real processes that a stage that keeps
its inputs keeps them intact while a stage that does not receives into the same memory every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeclock import schedule
from pipeclock.engine.receive_buffers import ReceiveBuffers
from pipeclock.model import ShardedMLP
from tests.distributed import run_ok

CPU = torch.device("cpu")


def test_a_buffer_is_reused_once_nothing_holds_what_was_received_into_it():
    buffers = ReceiveBuffers(CPU)
    first = buffers.take((4, 3), torch.float32)
    address = first.data_ptr()
    del first
    assert buffers.take((4, 3), torch.float32).data_ptr() == address
    assert buffers.allocated == 1


def test_a_buffer_still_held_in_any_way_is_not_handed_out_again():
    buffers = ReceiveBuffers(CPU)
    held = buffers.take((4, 3), torch.float32)  # a plain reference
    viewed = buffers.take((4, 3), torch.float32)[1:]  # only a view of it
    saved = buffers.take((4, 3), torch.float32).requires_grad_()
    graph = (saved * saved).sum()  # autograd saves it for the backward
    saved_address = saved.data_ptr()
    del saved
    fresh = buffers.take((4, 3), torch.float32)
    fresh_address = fresh.data_ptr()
    assert fresh_address not in {held.data_ptr(), viewed.data_ptr() - 3 * 4, saved_address}
    assert buffers.allocated == 4
    del graph, fresh  # the graph let go of its input: both buffers are free again
    assert buffers.take((4, 3), torch.float32).data_ptr() in {saved_address, fresh_address}
    assert buffers.allocated == 4


def test_a_buffer_is_kept_for_its_own_shape_and_dtype_only():
    buffers = ReceiveBuffers(CPU)
    taken = buffers.take((4, 3), torch.float32)
    del taken
    assert buffers.take((3, 4), torch.float32).shape == (3, 4)
    assert buffers.take((4, 3), torch.int64).dtype == torch.int64
    assert buffers.allocated == 3


def test_buffers_a_step_did_not_use_are_let_go_at_its_end():
    buffers = ReceiveBuffers(CPU)
    buffers.take((8,), torch.float32)
    buffers.end_step()  # used this step: kept
    buffers.take((8,), torch.float32)
    assert buffers.allocated == 1
    buffers.end_step()
    buffers.take((2,), torch.float32)
    buffers.end_step()  # the step used only (2,): the (8,) buffer is let go
    buffers.take((8,), torch.float32)
    assert buffers.allocated == 3


class KeepsItsInputs(nn.Module):
    """A stage that stores every input it is given, and a copy of it to compare with later."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.kept = inner, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept.append((x, x.detach().clone()))
        return self.inner(x)


def _received_over_steps(rank: int, world: int) -> dict[str, object]:
    keeper = KeepsItsInputs(ShardedMLP(8, 4, rank, world))
    keeping = schedule.Pipeline(keeper, "1f1b", 2, F.mse_loss)
    plain = schedule.Pipeline(ShardedMLP(8, 4, rank, world), "1f1b", 2, F.mse_loss)
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        keeping.step(x, y)
        plain.step(x, y)
    return {
        "intact": all(torch.equal(x, copy) for x, copy in keeper.kept),
        "inputs kept": len(keeper.kept),
        "allocated": (keeping.messenger.buffers.allocated, plain.messenger.buffers.allocated),
    }


def test_a_stage_that_keeps_its_inputs_keeps_them_intact_and_one_that_does_not_reuses_their_memory():
    first, second = run_ok(_received_over_steps, 2)
    assert second["intact"] and second["inputs kept"] == 6  # two micro-batches a step, three steps
    # each kept input in its own buffer; two for all six inputs otherwise, as a micro-batch's receive is
    # posted one action ahead, while the one before is still held
    assert second["allocated"] == (6, 2)
    assert first["allocated"] == (2, 2)  # the gradients coming back: never held past a step
