"""The model a checkpoint holds, as generation builds and runs it on one rank: the GPT's pieces with
``models.decoding``, or a Hugging Face model's ``HFStage`` with ``models.hf.decoding``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeclock.generation.pipeline import GPT_DECODING, Decoding
from pipeclock.models.gpt import GPT, GPTConfig
from pipeclock.models.registry import describe, hf_config

BYTES = 256  # the models read and write bytes: a larger vocabulary is sampled among its first 256


@dataclass(frozen=True)
class StageModel:
    """A checkpoint's context and hidden size, how rank r of p builds its stage, and how it decodes."""

    seq_len: int
    dim: int
    build: Callable[[int, int], torch.nn.Module]
    decoding: Decoding

    @classmethod
    def of(cls, run_info: dict, path, world: int) -> StageModel:
        """Refuses (one line) a model that is not a language model, or has fewer pieces than ``world``."""
        if run_info.get("model") == "GPT":
            config = GPTConfig(**run_info["gpt"])
            GPT.stage_pieces(config, world)
            build = lambda r, p: GPT.for_rank(config, r, p)[0]  # noqa: E731
            return cls(config.seq_len, config.dim, build, Decoding(GPT_DECODING.new_cache, _gpt_among_bytes))
        if run_info.get("model") == "HF":
            return cls._hf(run_info, world)
        raise ValueError(
            f"{path} holds a {describe(run_info)}, not a GPT or a Hugging Face model: no text to generate"
        )

    @classmethod
    def _hf(cls, run_info: dict, world: int) -> StageModel:
        from pipeclock.models import hf
        from pipeclock.models.hf.decoding import HFPromptCache, forward_cached

        config = hf.prepared_config(hf_config(run_info))
        trusted = bool(run_info.get("trust_remote_code"))
        hf.build.stage_cut(hf.layout_of(config, trusted), world, None)
        seed = run_info.get("seed", 0)

        def among_bytes(stage, inputs: torch.Tensor, cache) -> torch.Tensor:
            out = forward_cached(stage, inputs, cache)
            return out[:BYTES] if stage.has_head else out

        build = lambda r, p: hf.split(config, r, p, seed=seed, trust_remote_code=trusted)  # noqa: E731
        return cls(run_info["seq_len"], config.hidden_size, build, Decoding(HFPromptCache, among_bytes))


def _gpt_among_bytes(pieces: torch.nn.Module, inputs: torch.Tensor, cache) -> torch.Tensor:
    """The GPT's cached forward; on the head's stage (1-D logits) only the bytes' logits, so that a GPT
    trained on a prepared bytes folder (its end-of-text id 256 included) never samples past a byte."""
    out = GPT_DECODING.forward(pieces, inputs, cache)
    return out[:BYTES] if out.dim() == 1 else out
