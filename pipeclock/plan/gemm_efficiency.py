"""How a matrix product's share of the peak grows with the size of its weight.

A GPU runs a product in tiles spread over its multiprocessors; a weight with a short side leaves tiles
part-filled and waves part-empty, and spends a larger share of its time starting and draining them.
Published runs show it: Megatron-LM's widest layers (width 20,480 and 25,600, split 8 ways) ran at
59-64 % of an A100's peak, its narrower ones at less. So a product's share of the peak is its kind's
``gemm_efficiency`` scaled by ``d / (d + GEMM_HALF_SIZE)`` of its weight's shorter side ``d`` on one tp
rank, relative to that factor at ``GEMM_REFERENCE_SIDE``: the kind's constant is the share of a product
whose weight's shorter side is the reference; shorter ones reach less, longer ones more, up to
``(GEMM_REFERENCE_SIDE + GEMM_HALF_SIZE) / GEMM_REFERENCE_SIDE`` times it. ``GEMM_HALF_SIZE = 0`` makes
every product the constant. The tokens are left out: their count is a product's long side in every
run here, and the operands' trips through memory, charged apart (`pipeclock.plan.cluster_time`), are
what a short one costs.
"""

from __future__ import annotations

from pipeclock.plan import calibration


def size_factor(k: float, n: float) -> float:
    """A product's share of the peak over its kind's constant, for a (k x n) weight on one tp rank."""
    half, reference = calibration.GEMM_HALF_SIZE, calibration.GEMM_REFERENCE_SIDE
    side = min(k, n)
    return side / (side + half) * (reference + half) / reference
