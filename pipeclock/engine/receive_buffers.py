"""Receive buffers kept from one step to the next, as torch's own pipeline stages keep theirs.

Every step receives the same activations and gradients, shaped alike. Allocating a fresh buffer for each
made each step fault its memory in again: at hidden 512 a received activation is 512 KB, and with the
allocator handing freed memory back to the system between steps, a four-rank step on two cores took
hundreds of page faults more than torch's, whose stages allocate their receive buffers once. So a
buffer is kept, and reused for a receive of the same shape and dtype once nothing holds what was last
received into it.

Nothing means nothing: the tensor handed out is a view of the kept buffer, so whoever holds it (the
step's stash, autograd's saved tensors, a gradient still being sent, a module that stored its input)
holds the buffer's storage, and the buffer is reused only when the storage's use count says the pool is
its only holder, in the same step too: a 1F1B step of many micro-batches keeps as many buffers as it
holds received tensors at once, not one per micro-batch. Buffers not taken in a step are let go at its
end, so the pool never holds more than the last step used at once (training after evaluating a batch of
another size allocates anew).

Only on the CPU: CUDA's caching allocator already reuses memory, and a reused buffer there would also
have to wait for the kernels still reading it.
"""

from __future__ import annotations

import torch

# The kept buffer itself and the storage object the count is read through: nobody else.
_FREE_USE_COUNT = 2


class ReceiveBuffers:
    """The buffers one rank receives into, by shape and dtype."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cpu"
        self.device = device
        self._kept: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}
        self._taken: set[int] = set()  # id of each buffer taken this step
        self.allocated = 0  # buffers allocated so far (for tests and measurements)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor to receive into: a view of a kept buffer that nothing holds, else a new one."""
        if not self.enabled:
            self.allocated += 1
            return torch.empty(shape, dtype=dtype, device=self.device)
        kept = self._kept.setdefault((torch.Size(shape), dtype), [])
        for buffer in kept:
            if _only_kept(buffer):
                self._taken.add(id(buffer))
                return buffer.detach()
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self.allocated += 1
        kept.append(buffer)
        self._taken.add(id(buffer))
        return buffer.detach()

    def end_step(self) -> None:
        """Let go of the buffers this step did not use."""
        for key, kept in list(self._kept.items()):
            kept[:] = [buffer for buffer in kept if id(buffer) in self._taken]
            if not kept:
                del self._kept[key]
        self._taken.clear()


def _only_kept(buffer: torch.Tensor) -> bool:
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) == _FREE_USE_COUNT
