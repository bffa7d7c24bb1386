"""The few families a split would get wrong, refused by model type before anything is built.

Everything else about a family is read from the model itself. These are what the family sweep
(``python -m tools.hf_sweep``, docs/hf/families.md) finds that no such reading can see: values the
model computes once, before its layers, that every layer then reads besides the hidden states.
"""

from __future__ import annotations

from pipeclock.models.hf.structure import NotUnderstood

_BEFORE = "every layer reads what the base model computes from the token ids before the layers"
REFUSED: dict[str, str] = {
    "cpmant": f"{_BEFORE} (learned prompt tokens, position buckets)",
    "prophetnet": f"{_BEFORE} (the n-gram streams' positions, from a learned embedding)",
    "inkling2_text": f"{_BEFORE} (each layer's inputs, from the embeddings)",
    "inkling2_loop_text": f"{_BEFORE} (each layer's inputs, from the embeddings)",
    "xlstm": "its layers hand each other their recurrent state as nested tuples, which do not travel",
}


def refuse_known(config) -> None:
    """One line for a family of `REFUSED`: its type and why."""
    reason = REFUSED.get(getattr(config, "model_type", ""))
    if reason is not None:
        raise NotUnderstood(f"{type(config).__name__} ({config.model_type}) is not split: {reason}")
