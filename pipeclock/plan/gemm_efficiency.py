"""How a matrix product's share of the peak grows with the size of its weight.

A GPU runs a product in tiles spread over its multiprocessors; a weight with a short side leaves tiles
part-filled and waves part-empty, and spends a larger share of its time starting and draining them.
Published runs show it: Megatron-LM's widest layers (width 20,480 and 25,600, split 8 ways) ran at
59-64 % of an A100's peak, its narrower ones at less. So a product's share of the peak is its kind's
``gemm_efficiency`` scaled by ``d / (d + half)`` of its weight's shorter side ``d`` on one tp rank
(``half``: the kind's ``*_GEMM_HALF_SIZE``), relative to that factor at ``GEMM_REFERENCE_SIDE``: the
kind's constant is the share of a product whose weight's shorter side is the reference; shorter ones
reach less, longer ones more, up to ``(GEMM_REFERENCE_SIDE + half) / GEMM_REFERENCE_SIDE`` times it. A
half size of 0 makes every product the constant. The tokens are left out: their count is a product's
long side in every run here, and the operands' trips through memory, charged apart
(`pipeclock.plan.cluster_time`), are what a short one costs.
"""

from __future__ import annotations

from pipeclock.plan import calibration


def half_size(kind: str) -> float:
    """The half size of a GPU kind: the A100s' own, every other kind the H100's (as their constant)."""
    return calibration.A100_GEMM_HALF_SIZE if kind.startswith("A100") else calibration.H100_GEMM_HALF_SIZE


def size_factor(k: float, n: float, half: float) -> float:
    """A product's share of the peak over its kind's constant, for a (k x n) weight on one tp rank."""
    reference = calibration.GEMM_REFERENCE_SIDE
    side = min(k, n)
    return side / (side + half) * (reference + half) / reference
