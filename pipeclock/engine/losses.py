"""What a batch's loss averages over, so that micro-batch losses add up to the one-device loss.

A loss is a mean, but a mean of what? ``mse_loss`` averages over samples (and their elements, the same
count in every sample), so micro-batch k's mean weighted by its share of the samples gives the batch's
mean exactly. A language model's token loss averages over the tokens that count: with padding
(``ignore_index``) spread unevenly, micro-batches of equal size hold different numbers of counted tokens,
and weighting by samples gives another number than one device (4.2429 against 4.2066 in one case).

So a loss may say what it counts. A loss function with a ``count(targets)`` method returns the *sum*
over what it counts, and the pipeline divides every micro-batch's sum by the whole batch's count: the
batch's token mean, exactly, whatever the split. A plain callable is a mean over samples, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

LossFn = Callable[[Any, Any], torch.Tensor]


class TokenCrossEntropy:
    """Cross-entropy summed over the tokens whose target is not ``ignore_index``; ``count`` counts them.

    ``logits`` are ``(batch, tokens, vocab)`` and ``targets`` ``(batch, tokens)``. Given to a
    ``Pipeline``, the step's loss is the mean over every counted token of the batch, in nats.

    ``shift=True`` is Hugging Face's ``labels=`` meaning: the targets are the inputs' own labels, and the
    logits at position t predict the label at t + 1 (the first label and the last logits count for
    nothing), so ``model(ids, labels=ids)`` trains next-token prediction.
    """

    def __init__(self, ignore_index: int = -100, shift: bool = False):
        self.ignore_index = ignore_index
        self.shift = shift

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.shift:
            logits, targets = logits[:, :-1], targets[:, 1:]
        return F.cross_entropy(
            logits.flatten(0, -2).float(),
            targets.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )

    def count(self, targets: torch.Tensor) -> int:
        counted = targets[:, 1:] if self.shift else targets
        return int((counted != self.ignore_index).sum())

    def mean(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The one-device loss: the mean over the counted tokens (what a reference model computes)."""
        return self(logits, targets) / self.count(targets)


def counts_what(loss_fn: LossFn) -> bool:
    """True when ``loss_fn`` returns a sum and says what it counts (a ``count(targets)`` method)."""
    return callable(getattr(loss_fn, "count", None))


def loss_scales(
    loss_fn: LossFn,
    targets: Sequence[Any],
    sizes: Sequence[int],
    global_total: Callable[[int], int] = int,
) -> list[float]:
    """The factor each micro-batch's loss is multiplied by so that they add up to the batch's mean.

    Summed losses are divided by the batch's total count (a batch with nothing counted has no mean: the
    loss is NaN, as on one device); mean losses are weighted by their share of the samples. With data
    parallelism this rank's batch is one shard of the global batch: ``global_total`` turns this shard's
    total (samples or counted tokens) into the global batch's, so the shards' losses add up to its mean.
    """
    if not counts_what(loss_fn):
        samples = global_total(sum(sizes))
        return [size / samples for size in sizes]
    total = global_total(sum(loss_fn.count(target) for target in targets))  # type: ignore[attr-defined]
    return [1.0 / total if total else float("nan")] * len(targets)
