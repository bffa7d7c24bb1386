"""Shared cases for the Hugging Face tests: tiny configs, padded batches, and the unmodified HF reference."""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from pipeclock.engine import rng
from pipeclock.engine.ties import tie_key

VOCAB = 300
LAYERS = 6  # 8 pieces: enough for 4 ranks x 2 chunks


def gpt2_config(dropout: float = 0.0, layers: int = LAYERS):
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=16, n_layer=layers, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0,
    )  # fmt: skip


def llama_config(layers: int = LAYERS):
    """Grouped-query attention (4 heads, 2 key-value heads), rotary positions, an untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config}


def large_vocabulary_config():
    """A Llama whose embedding and head (32,000 x 512 each) outweigh five of its eight layers each: 55 M
    parameters, 221 MB in float32, large enough for a rank's share to stand out of what a process holds."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip


def padded_batch(
    batch: int, tokens: int, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(input_ids, attention_mask)`` and labels: sample i ends in ``i % 4`` padding positions, whose
    labels are -100, and one more label in the middle is ignored too."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=generator)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    for sample in range(batch):
        if sample % 4:
            mask[sample, -(sample % 4) :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, tokens // 2] = -100
    return (ids, mask), labels


def reference(config, seed: int, inputs, labels, step: int = 0):
    """The unmodified HF model on one process, with the split's weights, called with ``labels=``:
    its loss and every gradient by name (dropout keyed as in the split, so the masks are the same)."""
    model = _reference_model(config.to_json_string(), seed)
    model.zero_grad(set_to_none=True)
    ids, mask = inputs
    with rng.keyed(step=step, first_sample=0):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@functools.cache
def _reference_model(config_json: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeclock.models import hf

    config = AutoConfig.for_model(**json.loads(config_json))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf.build.prepared_config(config))
        model.load_state_dict(hf.whole(config, seed=seed).state_dict())
    hf.keyed(model, seed)
    return model.train()


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def worst_gap(loss: float, chunks, want_loss: float, want_grads: dict) -> float:
    """The worst relative gap of a pipelined step's loss and its chunks' gradients from the reference."""
    gaps = [abs(loss - want_loss) / abs(want_loss)]
    for chunk in chunks:
        for name, parameter in chunk.named_parameters():
            gaps.append(relative_gap(parameter.grad, want_grads[tie_key(parameter) or name]))
    return max(gaps)


def resident(field: str = "VmRSS") -> int:
    """This process's resident memory in bytes (``VmHWM``: its high-water mark) from /proc (Linux)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


def reset_resident_peak() -> None:
    """Start ``VmHWM`` again from the memory resident now."""
    Path("/proc/self/clear_refs").write_text("5")


def model_with_tokenizer(directory: Path, text: str, vocab_size: int = 320) -> None:
    """A ``from_pretrained`` directory as a user brings it: a tiny Llama's weights beside a byte-level BPE
    tokenizer trained here on ``text`` (offline, with the ``tokenizers`` library transformers uses)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    config = llama_config(layers=2)
    config.vocab_size = len(tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


def one_line_error(call) -> str:
    """The message of the ``ValueError`` or ``OSError`` that ``call()`` raises, asserted to be one line."""
    with pytest.raises((ValueError, OSError)) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message
