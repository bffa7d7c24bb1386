"""The models a run trains, by the name a checkpoint records: the whole one, for export and generation.

A checkpoint's ``pipeclock.json`` says which model it holds (``"model"``) and its size; from that alone a
single process rebuilds the whole model, loads every stage's weights into it, and exports or samples.
"""

from __future__ import annotations

import json

from torch import nn

from pipeclock.models.gpt import GPTConfig, gpt_sequential
from pipeclock.models.mlp import ShardedMLP


def full_model(run: dict) -> nn.Module:
    """The whole model a checkpoint's run description names, freshly initialised (weights to be loaded)."""
    if run.get("model") == "GPT":
        return gpt_sequential(GPTConfig(**run["gpt"]))
    if run.get("model") == "HF":
        from pipeclock.models import hf

        trusted = bool(run.get("trust_remote_code"))
        return hf.whole(hf_config(run), seed=run.get("seed", 0), trust_remote_code=trusted)
    return ShardedMLP(run["hidden"], run["layers"], seed=run.get("seed", 0))


def describe(run: dict) -> str:
    """``ShardedMLP 16 x 1024`` or ``GPT 4 blocks x 128 (4 heads, seq 128)``."""
    if run.get("model") == "GPT":
        gpt = run["gpt"]
        return f"GPT {gpt['layers']} blocks x {gpt['dim']} ({gpt['heads']} heads, seq {gpt['seq_len']})"
    if run.get("model") == "HF":
        config = run["hf_config"]
        kind = (config.get("architectures") or [config.get("model_type", "HF")])[0]
        return f"{kind} {config.get('num_hidden_layers', config.get('n_layer'))} layers (Hugging Face)"
    return f"ShardedMLP {run['layers']} x {run['hidden']}"


def same_model(saved: dict, wanted: dict) -> bool:
    """Whether a checkpoint's model is the one a run asks for (size and kind; dropout may differ)."""
    if saved.get("model", "ShardedMLP") != wanted.get("model"):
        return False
    if wanted.get("model") == "HF":
        return _comparable(saved["hf_config"]) == _comparable(wanted["hf_config"])
    if wanted.get("model") == "GPT":
        ignore = {"dropout"}
        return {k: v for k, v in saved["gpt"].items() if k not in ignore} == {
            k: v for k, v in wanted["gpt"].items() if k not in ignore
        }
    return (saved["hidden"], saved["layers"]) == (wanted["hidden"], wanted["layers"])


# The flag that sets each recorded size, where a flag does (a Hugging Face config's fields have none).
_FLAGS = {
    "hidden": "--hidden",
    "layers": "--layers",
    "dim": "--dim",
    "heads": "--heads",
    "seq_len": "--seq-len",
}


def differences(saved: dict, wanted: dict) -> list[str]:
    """What differs between two models of one kind, a field each: ``--hidden 16, not 32``
    (``hidden_size 64, not 32`` for a Hugging Face config); nothing for models of different kinds."""
    if saved.get("model", "ShardedMLP") != wanted.get("model", "ShardedMLP"):
        return []
    if wanted.get("model") == "HF":
        saved, wanted = _comparable(saved["hf_config"]), _comparable(wanted["hf_config"])
    elif wanted.get("model") == "GPT":
        saved, wanted = saved["gpt"], wanted["gpt"]
    else:
        saved, wanted = ({key: run.get(key) for key in ("hidden", "layers")} for run in (saved, wanted))
    return [
        f"{_FLAGS.get(key, key)} {saved.get(key)}, not {wanted.get(key)}"
        for key in sorted(saved.keys() | wanted.keys(), key=str)
        if key != "dropout" and saved.get(key) != wanted.get(key)
    ]


def hf_config(run: dict):
    """The Hugging Face config a checkpoint's run description holds (a model with its own code: the
    config of the directory that code is in, trusted as the run trusted it)."""
    from transformers import AutoConfig

    if run.get("trust_remote_code"):
        from pipeclock.models import hf

        return hf.config_of(run["trust_remote_code"], trust_remote_code=True)
    return AutoConfig.for_model(**run["hf_config"])


def run_tokens(run: dict):
    """The tokenizer a run read its text with (a ``Tokens``), or None for bytes.

    A checkpoint names the ``--hf-model`` directory whose tokenizer the run used; it must still be there,
    and give no id beyond the model's vocabulary (as training checks).
    """
    directory = run.get("tokenizer")
    if directory is None:
        return None
    from pipeclock.models.hf.tokens import Tokens, has_tokenizer

    if not has_tokenizer(directory):
        raise ValueError(
            f"the run read its text with the tokenizer in {directory}, which is no longer there: "
            "put that --hf-model directory back"
        )
    tokens, vocabulary = Tokens(directory), run["hf_config"].get("vocab_size")
    if vocabulary is not None and tokens.vocab_size > vocabulary:
        raise ValueError(
            f"the tokenizer in {directory} now gives {tokens.vocab_size} ids, more than the model's "
            f"vocabulary of {vocabulary}: put back the tokenizer the run was trained with"
        )
    return tokens


def _comparable(config: dict) -> dict:
    """An HF config without the fields that do not change the model (versions, dropout, dtype), as its
    JSON reads it back (a saved ``id2label``'s keys are strings, a config's own are ints)."""
    ignore = {"transformers_version", "torch_dtype", "dtype", "resid_pdrop", "embd_pdrop", "dropout"}
    plain = json.loads(json.dumps(config, default=str))
    return {key: value for key, value in plain.items() if key not in ignore}
