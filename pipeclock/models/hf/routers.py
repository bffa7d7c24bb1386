"""A mixture-of-experts model's router logits, gathered across stages for its auxiliary loss.

With ``output_router_logits=True`` a family's CausalLM adds ``router_aux_loss_coef`` times a
load-balancing loss to its loss, computed from every layer's router logits together (the fraction of
tokens each expert got, over all layers, times the mean probability routed to it, over all layers): not
a sum of per-layer terms, so no stage can add its part alone. Each stage therefore records its layers'
router logits (on the modules the family names in ``_can_record_outputs["router_logits"]``, the
output ``transformers`` itself records), appends them to those it received, and sends them on, batch
first, with their gradient flowing back; the head's stage hands them all to the family's own
CausalLM, whose code computes the auxiliary loss, as one process would.

With micro-batches the loss is each micro-batch's, weighted as the token loss is: what ``transformers``
gives when the batch is fed in the same micro-batches with gradient accumulation. One micro-batch is the
one-process loss itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pipeclock.engine.losses import TokenCrossEntropy


class WithRouterLoss(TokenCrossEntropy):
    """HF's ``labels=`` loss plus ``coefficient`` times the routers' auxiliary loss, for a stage that
    returns ``(logits, aux_loss)``: summed over counted tokens like the token loss, so the step's loss
    is each micro-batch's ``loss + coefficient * aux_loss`` weighted by its counted tokens."""

    def __init__(self, coefficient: float):
        super().__init__(shift=True)
        self.coefficient = coefficient

    def __call__(self, output, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(output, torch.Tensor):  # the family computed no auxiliary loss for this batch
            return super().__call__(output, targets)
        logits, aux_loss = output
        tokens = super().__call__(logits, targets)
        return tokens + self.coefficient * aux_loss.to(tokens.dtype) * self.count(targets)


class RouterLogits:
    """Which modules' outputs are a family's router logits, and whether the loss needs them."""

    def __init__(self, base: nn.Module, config):
        self.aux_loss = bool(getattr(config, "output_router_logits", False))
        self.target_class, self.class_name, self.index = _recorder(base)
        if self.aux_loss and self.target_class is None and self.class_name is None:
            raise ValueError(
                f"{type(config).__name__}.output_router_logits is set, but {type(base).__name__} names no "
                "router whose logits it records: set output_router_logits=False"
            )

    def _is_router(self, name: str, module: nn.Module) -> bool:
        if self.target_class is not None:
            return isinstance(module, self.target_class)
        return name.endswith(self.class_name)

    @contextmanager
    def collecting(self, layers: list[nn.Module], into: list[torch.Tensor]) -> Iterator[None]:
        """While inside, every router of ``layers`` appends its logits (tokens x experts) to ``into``."""
        if not self.aux_loss:
            yield
            return
        handles = []
        for layer in layers:
            for name, module in layer.named_modules():
                if self._is_router(name, module):
                    handles.append(module.register_forward_hook(self._recorder_hook(into)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _recorder_hook(self, into: list[torch.Tensor]):
        def record(module: nn.Module, args, output) -> None:
            logits = output[self.index] if isinstance(output, tuple | list) else output
            if logits is not None:
                into.append(logits)

        return record

    def pack(
        self, received: torch.Tensor | None, collected: list[torch.Tensor], batch: int
    ) -> torch.Tensor | None:
        """The logits so far as one message, ``(batch, layers, tokens, experts)``, or None when unused."""
        mine = [logits.reshape(batch, 1, -1, logits.shape[-1]) for logits in collected]
        so_far = ([received] if received is not None else []) + mine
        return torch.cat(so_far, dim=1) if self.aux_loss and so_far else None

    @staticmethod
    def unpack(message: torch.Tensor | None) -> list[torch.Tensor]:
        """Each layer's ``(batch x tokens, experts)`` logits, as the family's loss function takes them."""
        if message is None:
            return []
        return [message[:, i].reshape(-1, message.shape[-1]) for i in range(message.shape[1])]


def _recorder(base: nn.Module) -> tuple[type | None, str | None, int]:
    """What ``transformers`` records as ``router_logits`` for this base model: a class or a name, and
    the index of the logits in the module's output."""
    specs = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    if isinstance(specs, list):
        specs = specs[0] if specs else None
    if specs is None:
        return None, None, 0
    if isinstance(specs, type):
        return specs, None, 1
    if isinstance(specs, str):
        return None, specs, 1
    return getattr(specs, "target_class", None), getattr(specs, "class_name", None), specs.index
