"""A trained checkpoint back in Hugging Face's own format: a ``save_pretrained`` directory.

The names in pipeclock's checkpoints are HF's, so the whole model's state loads into the unmodified
``*ForCausalLM`` as it is, and ``AutoModelForCausalLM.from_pretrained(OUT)`` reads the trained weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_pretrained(state: dict[str, torch.Tensor], config, output: str | Path) -> Path:
    """Write ``state`` (the whole model's, HF names) with ``config`` as a ``from_pretrained`` directory."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    config.use_cache = True  # for generation; the pipeline turns it off itself
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=True, assign=True)
    if (
        model.get_output_embeddings().weight is not model.get_input_embeddings().weight
        and config.tie_word_embeddings
    ):
        model.tie_weights()
    model.save_pretrained(str(output))
    _follow_umask(Path(output))
    return Path(output)


def _follow_umask(directory: Path) -> None:
    """Give every file written the mode any new file gets here (safetensors writes its own 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)
