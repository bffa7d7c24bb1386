"""A GPT (decoder-only transformer) of our own, built stage by stage like ``ShardedMLP``.

The model is a sequence of ``layers + 2`` pieces, and a stage is a run of consecutive pieces:

    embed     token embedding (and dropout); hands on (hidden, positions)
    h0 .. hN  pre-norm blocks: x + attn(norm(x)), then x + mlp(norm(x)); causal self-attention through
              ``scaled_dot_product_attention``, rotary position embeddings
    head      final norm and the LM head, whose weight *is* the token embedding (GPT-2's tie)

The pieces form an ``nn.Sequential`` (``gpt_sequential``), so ``split_sequential`` cuts it like any other
model, and ``GPT.for_rank`` builds only a rank's own pieces under the same names: piece i's initial
weights depend only on (seed, i), so any cut equals the one-device model. Stages hand each other a tuple
``(hidden, positions)``: float hidden states, whose gradient flows back, and the int64 positions the
rotary embedding needs, which travel forward only.

The tie: on one device the head uses the embedding's matrix itself. Cut into stages, the head holds a
copy made from the same seed, marked with ``tie(..., "embed.wte.weight")``; the ``Pipeline`` sums both
copies' gradients after the backward, so the update is one device's, and checkpoints store the matrix
once, under that name.

For generation a block's attention may be given a ``LayerCache``, its keys and values for the tokens
seen so far (``models.decoding``): a new token then costs one position. Training never passes one.

Positions are rotary (RoPE): nothing to learn, and any sequence up to ``seq_len`` works. Dropout is
``KeyedDropout`` on the embedding and on each residual branch, so pipelined dropout equals one device's.

Tensor parallel (``tp_plan``) splits each block the Megatron way and the tied matrix by vocabulary; every
dropout then acts on activations that are whole on every tp rank, so its masks are one device's too.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeclock.engine.rng import KeyedDropout
from pipeclock.engine.ties import tie, tie_key
from pipeclock.models.partition import partition
from pipeclock.models.split import PlacementLike, resolve_placement, virtual_stages

TIED_KEY = "embed.wte.weight"
Hidden = tuple[torch.Tensor, torch.Tensor]  # (hidden states, positions)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    dim: int = 128
    layers: int = 4
    heads: int = 4
    seq_len: int = 128
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "layers", "heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPT {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"GPT dim {self.dim} is not divisible by heads {self.heads}")
        if (self.dim // self.heads) % 2:
            raise ValueError(
                f"GPT dim / heads = {self.dim // self.heads} must be even (rotary embeddings rotate pairs)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPT dropout must be in [0, 1), got {self.dropout}")

    @property
    def num_pieces(self) -> int:
        return self.layers + 2

    def as_dict(self) -> dict:
        return asdict(self)


class Embedding(nn.Module):
    """Token ids ``(batch, tokens)`` -> ``(hidden, positions)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.dim)
        self.drop = KeyedDropout(config.dropout, layer=0, seed=config.seed)
        self.seq_len = config.seq_len
        tie(self.wte.weight, TIED_KEY)

    def forward(self, ids: torch.Tensor, start: int = 0) -> Hidden:
        """``start``: the position of the first id (not 0 when earlier tokens sit in a key/value cache)."""
        if ids.dim() != 2 or start + ids.shape[1] > self.seq_len:
            raise ValueError(f"expected token ids of shape (batch, <= {self.seq_len}), got {list(ids.shape)}")
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        return self.drop(self.wte(ids)), positions


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings.

    The queries, keys and values are three Linears (initialised as one fused matrix, ``build_piece``)
    so that tensor parallel can split each by heads. The forward counts heads from its input's width,
    not from the config: split by tensor parallel, a rank runs its own share of the heads.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads, self.head_dim = config.heads, config.dim // config.heads
        self.q = nn.Linear(config.dim, config.dim)
        self.k = nn.Linear(config.dim, config.dim)
        self.v = nn.Linear(config.dim, config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """With a ``cache``, ``x`` holds the tokens that follow the cached ones: their keys and values join
        the cache and their queries attend to every cached token (a new token costs one position)."""
        batch, tokens, _ = x.shape
        dtype, x = x.dtype, _as_autocast_would(x)  # cast once for the three projections: one copy kept
        q, k, v = (self._heads(linear(x)) for linear in (self.q, self.k, self.v))
        cos, sin = _rotary(positions, self.head_dim, dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = cache.attend(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, -1))

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """``(batch, tokens, heads x head_dim)`` -> ``(batch, heads, tokens, head_dim)``."""
        batch, tokens, _ = projected.shape
        return projected.view(batch, tokens, -1, self.head_dim).transpose(1, 2)


def _as_autocast_would(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's compute dtype where autocast is on (each Linear would cast it, and keep its own
    copy for the backward); ``x`` itself otherwise."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


class LayerCache:
    """One attention layer's keys and values for the tokens seen so far, ``(batch, heads, tokens, head
    dim)`` each, in buffers of ``capacity`` tokens allocated once (the model's context)."""

    def __init__(self, attention: Attention, capacity: int, batch: int = 1, device=None):
        weight = attention.q.weight
        shape = (batch, attention.heads, capacity, attention.head_dim)
        dtype, device = weight.dtype, device or weight.device
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k``, ``v`` after the cached tokens; ``q``'s tokens attend causally to all of them."""
        start, tokens = self.length, k.shape[2]
        if start + tokens > self.keys.shape[2]:
            raise ValueError(
                f"the key/value cache holds {self.keys.shape[2]} tokens: {start} + {tokens} do not fit"
            )
        self.keys[:, :, start : start + tokens] = k
        self.values[:, :, start : start + tokens] = v
        self.length = start + tokens
        keys, values = self.keys[:, :, : self.length], self.values[:, :, : self.length]
        if start == 0:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        if tokens == 1:
            return F.scaled_dot_product_attention(q, keys, values)
        seen = (
            torch.arange(self.length, device=q.device)[None, :]
            <= torch.arange(start, self.length, device=q.device)[:, None]
        )
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen)

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _rotary(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, ``(batch, 1, tokens, head_dim / 2)``."""
    frequencies = 10000.0 ** (-torch.arange(0, head_dim, 2, device=positions.device) / head_dim)
    angles = positions[:, None, :, None].float() * frequencies
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of the head dimension by its position's angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig, index: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.fc = nn.Linear(config.dim, 4 * config.dim)
        self.out = nn.Linear(4 * config.dim, config.dim)
        self.drop1 = KeyedDropout(config.dropout, layer=2 * index + 1, seed=config.seed)
        self.drop2 = KeyedDropout(config.dropout, layer=2 * index + 2, seed=config.seed)

    def forward(self, inputs: Hidden, cache: LayerCache | None = None) -> Hidden:
        x, positions = inputs
        x = x + self.drop1(self.attn(self.ln1(x), positions, cache))
        x = x + self.drop2(self.out(F.gelu(self.fc(self.ln2(x)))))
        return x, positions


class Head(nn.Module):
    """The final norm and the LM head: ``(hidden, positions)`` -> logits ``(batch, tokens, vocab)``.

    ``lm_head.weight`` is the token embedding's matrix (the same tensor when the embedding is on this
    rank, a tied copy otherwise). It is an ``nn.Linear`` so that a split backward computes its weight
    gradient from this use alone, even when the same tensor also serves the embedding upstream.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        tie(self.lm_head.weight, TIED_KEY)

    def forward(self, inputs: Hidden) -> torch.Tensor:
        x, _ = inputs
        return self.lm_head(self.ln_f(x))


# --- building: only a rank's own pieces, each from (seed, piece index) ---------------------------------


def piece_name(index: int, config: GPTConfig) -> str:
    """``embed``, ``h0`` ... ``h{layers-1}``, ``head``: the names in the one-device ``nn.Sequential``."""
    if index == 0:
        return "embed"
    return "head" if index == config.num_pieces - 1 else f"h{index - 1}"


def build_piece(index: int, config: GPTConfig) -> nn.Module:
    """Piece ``index`` with its initial weights drawn from (seed, index) alone (GPT-2's scheme)."""
    if index == 0:
        piece: nn.Module = Embedding(config)
    elif index == config.num_pieces - 1:
        piece = Head(config)
    else:
        piece = Block(config, index - 1)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
    residual_std = 0.02 / math.sqrt(2 * config.layers)
    with torch.no_grad():
        for name, parameter in piece.named_parameters():
            if tie_key(parameter) == TIED_KEY:
                parameter.copy_(_embedding_matrix(config))
            elif name.endswith("bias"):
                parameter.zero_()
            elif name.startswith(("ln", "ln_f")):
                parameter.fill_(1.0)
            elif name.endswith("attn.q.weight"):  # q, k, v drawn as one matrix, in that order
                fused = torch.empty(3 * config.dim, config.dim).normal_(0.0, 0.02, generator=generator)
                for part, weight in zip(fused.chunk(3), _qkv_weights(piece), strict=True):
                    weight.copy_(part)
            elif not name.endswith(("attn.k.weight", "attn.v.weight")):
                std = residual_std if name.endswith(("attn.proj.weight", "out.weight")) else 0.02
                parameter.normal_(0.0, std, generator=generator)
    return piece


def _qkv_weights(block: nn.Module) -> list[torch.Tensor]:
    attention = block.attn
    return [attention.q.weight, attention.k.weight, attention.v.weight]


def _embedding_matrix(config: GPTConfig) -> torch.Tensor:
    """The tied matrix, drawn from the seed alone, so the embedding and the head start equal."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + 999_983)
    return torch.randn(config.vocab_size, config.dim, generator=generator) * 0.02


def _pieces(config: GPTConfig, indices: range) -> nn.Sequential:
    return nn.Sequential(OrderedDict((piece_name(i, config), build_piece(i, config)) for i in indices))


def _tie_locally(chunks: list[nn.Sequential]) -> None:
    """When the embedding and the head live on one rank, the head uses the embedding's own tensor."""
    embed = next((c.embed for c in chunks if hasattr(c, "embed")), None)
    head = next((c.head for c in chunks if hasattr(c, "head")), None)
    if embed is not None and head is not None:
        head.lm_head.weight = embed.wte.weight


def gpt_sequential(config: GPTConfig) -> nn.Sequential:
    """The whole model on one device, as one ``nn.Sequential`` (the reference every cut must equal)."""
    model = _pieces(config, range(config.num_pieces))
    _tie_locally([model])
    return model


class GPT:
    """Builders for a rank's share of the GPT; nothing of the other ranks' pieces is allocated."""

    @staticmethod
    def stage_pieces(config: GPTConfig, num_stages: int) -> list[range]:
        """Which pieces each virtual stage holds (the embedding and the head count as one piece each)."""
        if num_stages > config.num_pieces:
            raise ValueError(
                f"a GPT of {config.layers} blocks has {config.num_pieces} pieces (embedding, blocks, head): "
                f"it cannot be cut into {num_stages} stages; use at most {config.num_pieces} stages x chunks"
            )
        return partition(config.num_pieces, num_stages)

    @classmethod
    def for_rank(
        cls,
        config: GPTConfig,
        rank: int,
        num_stages: int,
        chunks: int = 1,
        placement: PlacementLike = None,
        cut: list[range] | None = None,
    ) -> list[nn.Sequential]:
        """Rank ``rank``'s chunks in virtual-stage order (the loop placement unless given; ``"v"``...);
        ``cut`` gives every virtual stage's pieces (a cut by cost), by default `stage_pieces`'."""
        resolved = resolve_placement(placement, num_stages, chunks)
        ranges = cut or cls.stage_pieces(config, resolved.num_virtual)
        parts = [_pieces(config, ranges[v]) for v in virtual_stages(rank, num_stages, chunks, resolved)]
        _tie_locally(parts)
        return parts


def tp_plan(config: GPTConfig, tp: int) -> dict[str, str]:
    """The GPT's tensor-parallel plan, in transformers' format, over ``gpt_sequential``'s names.

    A block the Megatron way: ``q``, ``k``, ``v`` split by columns, so each rank holds whole heads and
    attends with no message; the output projection by rows (one all-reduce of the branch); the MLP's
    ``fc`` by columns (the GELU on each rank's slice) and ``out`` by rows (one all-reduce).

    The token embedding and the tied LM head are split too, both by vocabulary (the rows of the one
    matrix): at this model's sizes the head's product costs as much as a block's attention, and the
    matrix is the largest one. The embedding then looks up only the ids in its rows and one all-reduce
    sums the lookups; the head computes its slice of the logits and one all-gather joins them, so the
    loss is taken on whole logits on every tp rank. Both ends hold the same rows, so the tie's copies on
    the first and the last stage are split alike and their gradients are summed slice by slice.

    Raises ``ValueError`` when ``tp`` does not divide the heads or the vocabulary.
    """
    heads, vocabulary = config.heads, config.vocab_size
    for size, what in (
        (heads, f"{heads} attention heads (--heads)"),
        (vocabulary, f"vocabulary of {vocabulary}"),
    ):
        if size % tp:
            raise ValueError(f"--tp {tp} does not divide the GPT's {what}")
    return {
        "embed.wte": "embedding_rowwise",
        "h*.attn.q": "colwise",
        "h*.attn.k": "colwise",
        "h*.attn.v": "colwise",
        "h*.attn.proj": "rowwise",
        "h*.fc": "colwise",
        "h*.out": "rowwise",
        "head.lm_head": "colwise_gather_output",
    }


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
