"""Watching a hand-written loop compute: which micro-batch each forward and backward of a stage is.

Hooks on the rank's model chunks see every forward (its input) and every backward (the gradient that
reaches the forward's output). A forward is named by what it computes on: the input of micro-batch i
at that virtual stage, as the one-process model has it, whatever order the loop took the messages in.
An input that matches no micro-batch (a wrong message: the checker names that fault itself) is named by
its place instead, the next micro-batch the schedule's forward order gives that chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeclock.engine.actions import Action


class Computes:
    """Installs forward and backward hooks on ``chunks`` (rank-local chunk c is ``chunks[c]``); calls
    ``on_action(Action)`` as each F starts and as each B starts (its output's gradient has arrived).

    ``identify(chunk, x)`` names the micro-batch whose input ``x`` is, or None; ``fallback(chunk, k)``
    the micro-batch of the chunk's k-th forward by the schedule's order.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        identify: Callable[[int, torch.Tensor], int | None],
        fallback: Callable[[int, int], int],
        on_action: Callable[[Action], None],
    ) -> None:
        self.identify, self.fallback, self.on_action = identify, fallback, on_action
        self.forwards = [0] * len(chunks)
        self.current: int | None = None  # the micro-batch of the forward that ran last, and its chunk
        self.chunk = 0
        self.handles = []
        for c, chunk in enumerate(chunks):
            self.handles.append(chunk.register_forward_pre_hook(self._before(c)))
            self.handles.append(chunk.register_forward_hook(self._after(c)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _before(self, chunk: int):
        def hook(module, args):
            x = args[0] if args else None
            found = self.identify(chunk, x) if isinstance(x, torch.Tensor) else None
            k = self.forwards[chunk]
            self.forwards[chunk] += 1
            self.current = found if found is not None else self.fallback(chunk, k)
            self.chunk = chunk
            self.on_action(Action("F", self.current, chunk))

        return hook

    def _after(self, chunk: int):
        def hook(module, args, output):
            microbatch = self.current
            if isinstance(output, torch.Tensor) and output.requires_grad and microbatch is not None:
                output.register_hook(lambda grad: self._backward(microbatch, chunk))

        return hook

    def _backward(self, microbatch: int, chunk: int) -> None:
        self.on_action(Action("B", microbatch, chunk))
