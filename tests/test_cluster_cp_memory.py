"""What context parallel holds at a layer's backward (`pipeclock.plan.context_parallel.working_bytes`):
the gathered keys and values and, under torch's all-gather, its ring backward's own buffers, counted from
``_templated_ring_attention_backward``; none of it meets the head's backward, which runs before."""

from __future__ import annotations

import pytest

from pipeclock.plan import context_parallel
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import gpu_memory
from pipeclock.plan.paper_model import PaperModel

# 32 query heads and 8 key/value heads of 128: keys and values 1,024 wide, queries 4,096
GQA = PaperModel("GQA 24 x 4096", 24, 4096, 32, 8, 128, 14336, 128256)
SMALL_HEAD = PaperModel("GQA, vocabulary 1,024", 24, 4096, 32, 8, 128, 14336, 1024)


def config(cp: int) -> Config:
    return Config(1, 1, 2, "1f1b", 1, 1, 1, "full", 3, False, cp=cp)


def test_torchs_backward_holds_the_gathered_blocks_and_its_fp32_gradients_three_times():
    job, cp = Job(2, 16384), 4
    tokens = 16384 // cp  # a rank's share of one sequence
    block = tokens * 2 * 1024 * 2  # its keys and values, bf16
    queries = tokens * 4096  # elements of its queries
    # gathered (cp blocks), the local keys and values concatenated (1), their fp32 gradients received,
    # updated and concatenated to send (3 x 2 blocks), the kernel's key and value gradients (1); the
    # queries' fp32 gradient (4 bytes) and the kernel's (2)
    expected = (cp + 1 + 6 + 1) * block + 6 * queries
    software = Software("bf16", fused=True)
    assert context_parallel.working_bytes(GQA, config(cp), job, software) == pytest.approx(expected)
    ring = Software("bf16", fused=True, cp_exchange="ring")
    exposed = Software("bf16", fused=True, cp_exchange="all-gather-exposed")
    assert context_parallel.working_bytes(GQA, config(cp), job, ring) == pytest.approx(2 * block)
    assert context_parallel.working_bytes(GQA, config(cp), job, exposed) == pytest.approx(cp * block)


def test_the_exchanges_buffers_add_to_the_rebuilt_layer_not_to_the_heads_backward():
    software = Software("bf16", fused=True)
    # the same tokens on a rank: 8,192 at cp 1, 16,384 over cp 2
    whole, split = Job(2, 8192), Job(2, 16384)
    exchange = context_parallel.working_bytes(SMALL_HEAD, config(2), split, software)
    small = [
        gpu_memory(SMALL_HEAD, config(cp), job, software).working for cp, job in ((1, whole), (2, split))
    ]
    assert small[1] - small[0] == pytest.approx(exchange)  # the rebuilt layer is the larger: added
    large = [gpu_memory(GQA, config(cp), job, software).working for cp, job in ((1, whole), (2, split))]
    assert large[1] == pytest.approx(large[0])  # a 128,256-word head's backward is larger still: unchanged


def test_torchtitans_context_parallel_rows_are_predicted_within_10_percent_of_their_published_memory():
    """Tables 2 and 6 of torchtitan's benchmarks/llama3_h100_202412_torchtitan.md, cp 2 to 8."""
    from benchmarks.cluster_check import errors, predict
    from benchmarks.published_2024 import titan_rows

    rows = [row for row in titan_rows() if row.fixed.get("cp", 1) > 1]
    assert len(rows) == 6
    for row in rows:
        row.predicted = predict(row)
        memory = errors(row)[1]
        assert abs(memory) <= 0.10, f"{row.source} {row.name}: {memory:+.1%}"
