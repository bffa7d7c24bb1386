"""The models the profile knows, described so that it can build and feed them one layer at a time:
the built-in MLP and GPT, and a Hugging Face causal LM from its config (``ModelSpec``). Only a layer or
a few exist at once: the profile must not need the whole model, which may be too large for one process."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.models.gpt import GPTConfig, build_piece, piece_name
from pipeclock.models.mlp import ShardedMLP


@dataclass(frozen=True)
class ModelSpec:
    """How to build and feed a model one layer at a time.

    ``build(i)`` makes layer i alone (from (seed, i), as a stage would); ``kind(i)`` names its build
    (layers of one kind are measured once); ``batch(n)`` gives a micro-batch's inputs and targets.
    """

    name: str
    num_layers: int
    build: Callable[[int], nn.Module]
    kind: Callable[[int], str]
    layer_name: Callable[[int], str]
    batch: Callable[[int], tuple]
    loss_fn: Callable


def mlp_spec(hidden: int, layers: int, seed: int = 0) -> ModelSpec:
    """``ShardedMLP``: layer i is a one-layer stage (Linear and ReLU; the last has no ReLU)."""

    def batch(n: int) -> tuple:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(n, hidden, generator=generator), torch.randn(n, hidden, generator=generator)

    return ModelSpec(
        name=f"ShardedMLP {layers} x {hidden}",
        num_layers=layers,
        build=lambda i: ShardedMLP(hidden, layers, stage=i, num_stages=layers, seed=seed),
        kind=lambda i: "last" if i == layers - 1 else "layer",
        layer_name=str,
        batch=batch,
        loss_fn=F.mse_loss,
    )


def gpt_spec(config: GPTConfig) -> ModelSpec:
    """The GPT's pieces: the embedding, the blocks, the head (which also computes the loss)."""
    last = config.num_pieces - 1

    def batch(n: int) -> tuple:
        generator = torch.Generator().manual_seed(config.seed)
        ids = torch.randint(0, config.vocab_size, (n, config.seq_len + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]

    return ModelSpec(
        name=f"GPT {config.layers} blocks x {config.dim}",
        num_layers=config.num_pieces,
        build=lambda i: nn.Sequential(OrderedDict([(piece_name(i, config), build_piece(i, config))])),
        kind=lambda i: "embed" if i == 0 else ("head" if i == last else "block"),
        layer_name=lambda i: piece_name(i, config),
        batch=batch,
        loss_fn=TokenCrossEntropy(),
    )


def hf_spec(config, seq_len: int, seed: int = 0) -> ModelSpec:
    """A Hugging Face causal LM's pieces (``pipeclock.models.hf``): the embedding, each decoder layer, and
    the head with the final norm, each built alone as a one-piece stage (on the meta device, then only the
    piece given memory), fed token ids of ``seq_len`` and measured with HF's ``labels=`` loss.

    A tied head built alone holds its own copy of the embedding's matrix, as a rank without the
    embedding does; both are marked tied, so a rank holding both ends counts the matrix once.
    """
    from pipeclock.models import hf

    config = hf.prepared_config(hf.config_of(config))
    layout = hf.layout_of(config)
    last = layout.num_pieces - 1

    def build(i: int) -> nn.Module:
        return hf.split(config, i, layout.num_pieces, seed=seed)

    def name(i: int) -> str:
        if i == 0:
            return layout.input_embedding
        return layout.head if i == last else f"{layout.base}.{layout.layers}.{i - 1}"

    def batch(n: int) -> tuple:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, config.vocab_size, (n, seq_len), generator=generator)
        return ids, ids  # the loss shifts: logits at t predict the token at t + 1

    kind = (config.architectures or [config.model_type])[0]
    return ModelSpec(
        name=f"{kind} {layout.num_layers} layers x {config.hidden_size} (vocab {config.vocab_size:,})",
        num_layers=layout.num_pieces,
        build=build,
        kind=lambda i: "embed" if i == 0 else ("head" if i == last else "layer"),
        layer_name=name,
        batch=batch,
        loss_fn=hf.loss(),
    )
