"""ZeRO-3 on one stage, as FSDP2 runs it: each block's gathers and reduce-scatter fall where FSDP2 issues
them, and only the compute of the block before hides them."""

from __future__ import annotations

import pytest

from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_time import step_time
from pipeclock.plan.gpus import KINDS
from pipeclock.plan.paper_model import PaperModel
from pipeclock.plan.zero3_time import Unit, backward_exposed, forward_exposed, microbatch_exposed, units

MODEL = PaperModel("test 1.2B", layers=16, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632,
                   vocab=32000)  # fmt: skip
H100 = KINDS["H100-80GB"]


def blocks(n: int, forward: float, gather: float, reduce: float = 0.0) -> list[Unit]:
    return [Unit(forward, 2 * forward, gather, reduce) for _ in range(n)]


def test_the_first_gather_is_exposed_and_the_others_hide_behind_the_block_before():
    assert forward_exposed(blocks(8, forward=1.0, gather=0.4)) == pytest.approx(0.4)


def test_a_gather_longer_than_the_block_before_shows_by_the_difference():
    assert forward_exposed(blocks(8, forward=1.0, gather=1.5)) == pytest.approx(1.5 + 7 * 0.5)


def test_the_backward_waits_for_its_first_gather_and_its_last_reduce_scatter():
    # each block's backward (2.0) hides the next gather and its own reduce-scatter (0.4 + 0.8)
    assert backward_exposed(blocks(8, forward=1.0, gather=0.4, reduce=0.8)) == pytest.approx(0.4 + 0.8)


def test_a_backward_its_link_cannot_keep_up_with_takes_as_long_as_the_link():
    # per block 1.5 + 1.5 on the link against 2.0 of compute: the link's 24 set the pass, within a block
    exposed = backward_exposed(blocks(8, forward=1.0, gather=1.5, reduce=1.5))
    assert 24 - 16 <= exposed <= 24 - 16 + 2.0
    assert microbatch_exposed(blocks(8, 1.0, 1.5, 1.5)) == pytest.approx(exposed + 1.5 + 7 * 0.5)


def dp_exposed(dp: int, microbatch_size: int = 1, microbatches: int = 1) -> float:
    config = Config(tp=1, pp=1, dp=dp, schedule="1f1b", chunks=1, microbatch_size=microbatch_size,
                    microbatches=microbatches, recompute="none", zero=3, sequence_parallel=False)  # fmt: skip
    return step_time(MODEL, config, Job(dp * microbatch_size * microbatches, 2048), Software("bf16"), H100).dp


def test_the_exposed_gathers_grow_when_dp_crosses_nodes_and_with_dp_across_them():
    inside, across, wider = dp_exposed(8), dp_exposed(16), dp_exposed(64)
    assert inside < across < wider


def test_the_exposed_gathers_shrink_with_more_compute_per_block():
    assert dp_exposed(64, microbatch_size=4) < dp_exposed(64, microbatch_size=1)


def test_every_microbatch_gathers_and_reduces_again():
    assert dp_exposed(64, microbatches=4) == pytest.approx(4 * dp_exposed(64, microbatches=1))


def test_the_root_is_gathered_with_the_first_block_and_with_the_last_block_kept_for_the_backward():
    # embedding 10, a block 1, head 10 parameters; a parameter gathers in 0.1 s and reduces in 0.2 s
    built = units(4, (1.0, 2.0), (0.0, 0.0, 0.0, 0.0), (10.0, 1.0, 10.0), (0.1, 0.2), 0.0)
    assert built[0].gather == pytest.approx(2.1) and built[0].reduce == pytest.approx(4.2)
    assert built[0].backward_gather == pytest.approx(0.1)  # the block again, not the root
    assert built[-1].backward_gather == 0.0 and built[-1].reduce == pytest.approx(0.2)


def test_fsdp_holds_two_blocks_and_its_root_gathered():
    from pipeclock.plan.cluster_memory import gpu_memory

    config = Config(tp=1, pp=1, dp=64, schedule="1f1b", chunks=1, microbatch_size=1, microbatches=1,
                    recompute="none", zero=3, sequence_parallel=False)  # fmt: skip
    memory = gpu_memory(MODEL, config, Job(64, 2048), Software("bf16"))
    root = MODEL.embedding_parameters() + MODEL.head_parameters()
    assert memory.weights == pytest.approx(2 * (2 * MODEL.layer_parameters() + root))
