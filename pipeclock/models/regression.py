"""A synthetic regression task that a deep MLP really learns, reproducible from (seed, step) alone.

Each sample lives on a low-dimensional manifold: a latent ``z`` of a few dimensions is embedded in the
``hidden``-dimensional input by a fixed random projection, and the target is a smooth function of ``z``
(``sin(z)`` projected back up). A 16-layer MLP fits it within a few hundred steps, so a learner sees the
loss fall by a large factor.

Batch k is drawn from a generator seeded with (seed, k), so any rank can make exactly the batch it needs
and a resumed run sees the same data as an uninterrupted one: the data position is the step number.
"""

from __future__ import annotations

import torch


class SyntheticRegression:
    """``batch(step, size) -> (inputs, targets)``, both ``(size, hidden)`` float32."""

    def __init__(self, hidden: int, seed: int = 0, latent: int = 4):
        fixed = torch.Generator().manual_seed(10_007 * seed + 1)
        self.hidden, self.seed, self.latent = hidden, seed, latent
        self.embed = torch.randn(latent, hidden, generator=fixed) / latent**0.5
        self.readout = torch.randn(latent, hidden, generator=fixed) / latent**0.5

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1_000_003 * self.seed + step)
        z = torch.randn(size, self.latent, generator=generator)
        return z @ self.embed, torch.sin(z) @ self.readout
