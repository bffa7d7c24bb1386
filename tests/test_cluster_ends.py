"""The ends of the pipeline in a block's slot each (``--fix ends=slot``, Meta's Llama 3 pipeline): the
first and the last stages hold a block fewer, and a rank's activations are counted chunk by chunk."""

from __future__ import annotations

from pipeclock.plan.activations import layer_bytes
from pipeclock.plan.cluster_config import Config, Job, Software
from pipeclock.plan.cluster_memory import gpu_memory, held_microbatches, stage_layers
from pipeclock.plan.gpus import KINDS, Cluster
from pipeclock.plan.paper_model import PaperModel
from pipeclock.plan.search import search

# Llama 3 405B's shape (arXiv 2407.21783 Table 3; docs/cluster/llama-3.1-405b.json)
LLAMA_405B = PaperModel("Llama 3 405B", layers=126, hidden=16384, heads=128, kv_heads=8, head_dim=128,
                        ffn=53248, vocab=128256)  # fmt: skip
GIB = 2**30


def meta_config(ends: str, chunks: int = 8, microbatches: int = 16) -> Config:
    """Table 4's 16,384-GPU layout: tp 8 (with sequence parallel) x pp 16 x dp 128, 16 sequences of 8,192
    per dp rank, no recompute, gradients and optimizer state sharded (Meta's FSDP)."""
    return Config(8, 16, 128, "interleaved-1f1b", chunks, 1, microbatches, "none", 2, True, ends=ends)


def test_with_the_ends_in_slots_the_first_and_the_last_stages_hold_a_block_fewer():
    model = PaperModel(
        "ten blocks", layers=10, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=128, vocab=100
    )
    four = Config(1, 4, 1, "1f1b", 1, 1, 4, "none", 0, False)
    assert [len(cut) for cut in stage_layers(model, four)] == [3, 3, 2, 2]
    assert [len(cut) for cut in stage_layers(model, Config(**{**four.__dict__, "ends": "slot"}))] == [
        2,
        3,
        3,
        2,
    ]
    # one block a virtual stage: the first holds the embedding alone, the last the head alone (Meta's)
    cuts = stage_layers(LLAMA_405B, meta_config("slot"))
    assert len(cuts[0]) == len(cuts[-1]) == 0 and {len(cut) for cut in cuts[1:-1]} == {1}
    assert [i for cut in cuts for i in cut] == list(range(126))


def test_a_rank_holds_the_blocks_of_the_chunks_its_micro_batches_are_in():
    """Rank 0's first chunk holds no block: of the 128 (micro-batch, chunk) pairs it holds at m = 16 (all
    of them), the 16 on its first chunk keep no block's activations; rank 1 keeps 128 blocks' worth."""
    config = meta_config("slot")
    cuts = stage_layers(LLAMA_405B, config)
    layers = tuple(tuple(len(cuts[s]) for s in range(r, 128, 16)) for r in range(16))
    held = held_microbatches("interleaved-1f1b", 16, 16, 8, layers)
    assert held[0] == (128, 0, 112) and held[1][2] == 128
    assert (
        held_microbatches("interleaved-1f1b", 16, 32, 8, layers)[1][2] == 141
    )  # m = 32: 2 x 14 + 7 x 16 + 1
    per_block = layer_bytes(LLAMA_405B, "none", 2, True, 8, True) * 8192
    memory = gpu_memory(LLAMA_405B, config, Job(2048, 8192), Software("bf16", True))
    assert memory.activations == 128 * per_block


def test_metas_layout_of_16384_gpus_fits_80_gib_with_its_ends_in_slots_and_its_gradients_sharded():
    """Table 4's 16,384-GPU run with Meta's FSDP (gradients and optimizer state sharded, weights kept
    through the step: ZeRO-2) and its ends in slots (V = 8: 128 virtual stages for 126 blocks) fits; with
    the gradients whole through the step (ZeRO-3 under a pipeline) it does not, and riding ends (V = 4,
    two blocks a chunk) hold more."""
    cluster, job, software = Cluster(16384, KINDS["H100-80GB"]), Job(2048, 8192), Software("bf16", True)
    fixed = {"tp": 8, "pp": 16, "dp": 128, "recompute": "none", "schedule": "interleaved-1f1b",
             "microbatch-size": 1, "sp": True, "ends": "slot", "chunks": 8}  # fmt: skip
    assert search(LLAMA_405B, cluster, job, software, fixed | {"zero": 2}, top=1).ranked
    assert not search(LLAMA_405B, cluster, job, software, fixed | {"zero": 3}, top=1).ranked
    slot = gpu_memory(LLAMA_405B, meta_config("slot"), job, software)
    ride = gpu_memory(LLAMA_405B, meta_config("ride", 4), job, software)
    assert slot.total < 80 * GIB and slot.total < ride.total
    assert slot.weights < ride.weights  # rank 1's 8 blocks, where rank 0 held 8 and the embedding
