"""``train --compile``: ``torch.compile`` on each repeated block of a stage (GPT block, HF decoder layer).

A block is the unit that repeats: its copies share code and shapes, so one compilation serves them all,
while the pipeline's messages and the engine's bookkeeping between blocks stay eager, and a stage of any
cut holds whole blocks. A block's ``forward`` is compiled in place, after tensor parallel has split it and
before data parallel wraps it, so the compiled code sees the shards it runs; its parameters keep their
names (checkpoints are unchanged) and its hooks (an HF layer's keyed generator) stay eager. The first
step pays the compilation; the run reports it apart from the other steps.

Dropout stays exact where pipeclock keys it: ``KeyedDropout`` runs eagerly between compiled pieces. A
dropout a Hugging Face layer draws with ``F.dropout`` inside its forward would come from the compiler's
own generator, so that pair is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeclock.models.gpt import Block


def repeated_blocks(chunk: nn.Module) -> list[nn.Module]:
    """The blocks ``chunk`` holds: an HF stage's decoder layers, or the GPT's blocks; none for the MLP."""
    held = getattr(chunk, "decoder_layers", None)
    if callable(held):
        return list(held())
    return [module for module in chunk.modules() if isinstance(module, Block)]


def compile_blocks(chunks: list[nn.Module]) -> int:
    """Compile the ``forward`` of every repeated block of this rank's chunks, in place; how many."""
    blocks = [block for chunk in chunks for block in repeated_blocks(chunk)]
    for block in blocks:
        block.forward = torch.compile(block.forward)
    return len(blocks)


def check_compilable(config, hf_config=None) -> None:
    """``--compile`` where it cannot work is one line, before anything is built."""
    if not config.compile:
        return
    if config.model == "mlp":
        raise ValueError(
            "--compile compiles a language model's repeated blocks (--model gpt or hf); the MLP has none"
        )
    if config.recompute != "none":
        raise ValueError(
            f"--compile with --recompute {config.recompute}: a recomputed block is not compiled; choose one"
        )
    drawn = _functional_dropouts(hf_config) if hf_config is not None else []
    if drawn:
        raise ValueError(
            f"--compile with dropout inside the model's layers ({', '.join(drawn)}): a compiled layer draws "
            "its masks from the compiler's own generator, not pipeclock's keyed one; set them to 0 or drop "
            "--compile"
        )


def _functional_dropouts(hf_config) -> list[str]:
    """The config's dropout probabilities above 0 (``attention_dropout=0.1``), as ``name=value``."""
    found = []
    for name, value in sorted(hf_config.to_dict().items()):
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
            found.append(f"{name}={value:g}")
    return found
