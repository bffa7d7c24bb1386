"""``python -m benchmarks.hf_memory_wall``: what a rank of a 4-stage Hugging Face split really allocates.

Each rank runs in a fresh process (as under torchrun) and builds its stage with ``hf.split``; the
resident memory it gains while building (psutil's RSS, before and after) is set beside the bytes of the
parameters its pieces hold, which is the weights term of the planner's figure, and beside the whole
model's. Nothing of the other ranks' pieces should be allocated: the growth follows the rank's share.
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

RANKS = 4
CONFIG = dict(  # a Llama of 0.25 B parameters: the whole model is 0.94 GiB in float32
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
)  # fmt: skip


def one_rank(rank: int) -> dict:
    import torch
    from transformers import LlamaConfig

    from pipeclock.models import hf

    torch.set_num_threads(1)
    config = LlamaConfig(**CONFIG)
    hf.layout_of(config)  # imports and first-call costs, outside the measurement
    before = psutil.Process().memory_info().rss
    stage = hf.split(config, rank, RANKS, seed=0)
    grown = psutil.Process().memory_info().rss - before
    held = sum(p.numel() * p.element_size() for p in stage.parameters())
    return {"rank": rank, "rss_growth": grown, "parameter_bytes": held}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(one_rank(int(sys.argv[1]))))
        return
    whole = None
    for rank in range(RANKS):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.hf_memory_wall", str(rank)],
            capture_output=True,
            text=True,
            check=True,
        )
        found = json.loads(out.stdout.strip().splitlines()[-1])
        whole = whole or _whole_bytes()
        ratio = found["rss_growth"] / found["parameter_bytes"]
        print(
            f"rank {rank}: RSS grew {found['rss_growth'] / 2**20:7.1f} MiB, its parameters "
            f"{found['parameter_bytes'] / 2**20:7.1f} MiB (growth / parameters {ratio:.3f}), "
            f"the whole model {whole / 2**20:.1f} MiB"
        )


def _whole_bytes() -> int:
    from transformers import LlamaConfig

    from pipeclock.models.hf.build import meta_model

    return sum(p.numel() * 4 for p in meta_model(LlamaConfig(**CONFIG)).parameters())


if __name__ == "__main__":
    main()
