"""A model on paper: its shapes, and what they imply (parameters, FLOPs, bytes) without building it.

A decoder-only transformer is ``layers`` equal blocks between a token embedding and a head:

    block   norm -> q, k, v projections -> causal attention -> output projection -> + residual
            norm -> MLP (SwiGLU: gate, up, down; or two matrices and GELU) -> + residual
            (a mixture of experts: a router and ``experts`` MLPs, ``experts_per_token`` used per token;
            its first ``dense_layers`` blocks may keep a dense MLP, as DeepSeek's do)
    head    final norm -> the vocabulary projection (the embedding's matrix when ``tied``)

Grouped-query attention (``kv_heads`` < ``heads``) and the head size are the config's own. A ``kind="mlp"``
model is the course's ShardedMLP scaled up: ``layers`` square Linear layers with ReLUs, one token per
sample. Everything here is arithmetic on the shapes; `pipeclock.plan.hf_paper` reads the shapes from a
Hugging Face config.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from pipeclock.plan import latent_attention


@dataclass(frozen=True)
class Gemm:
    """One matrix product of a layer's forward, per token: (tokens x ``k``) @ (``k`` x ``n``), ``count``
    times per token (a mixture's experts: the ones a token is routed to). ``split``: what tensor parallel
    divides (``n``: column-parallel, ``k``: row-parallel, ``none``). ``kept``: selective recompute keeps
    its output (every other product, in the order the layer runs them: torchtitan's policy)."""

    role: str
    k: int
    n: int
    count: float = 1.0
    split: str = "n"
    kept: bool = True


@dataclass(frozen=True)
class PaperModel:
    name: str
    layers: int
    hidden: int
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    ffn: int = 0
    vocab: int = 0
    gated: bool = True  # SwiGLU (three matrices) or a plain two-matrix MLP
    tied: bool = False
    norm: str = "rms"  # "rms" (a weight) or "layer" (a weight and a bias)
    qkv_bias: bool = False
    linear_bias: bool = False  # every Linear has a bias (GPT-2's)
    positions: int = 0  # learned position embeddings (GPT-2's), 0 for rotary
    experts: int = 0
    experts_per_token: int = 0
    shared_ffn: int = 0  # a mixture's always-used expert(s), in total width
    kind: str = "transformer"  # or "mlp"
    # latent attention (MLA, `pipeclock.plan.latent_attention`; head_dim is then the non-rotary part)
    q_lora: int = 0
    kv_lora: int = 0  # 0: ordinary attention
    rope_dim: int = 0
    v_head_dim: int = 0
    # node-limited routing: the experts in ``expert_groups`` groups, a token's in ``groups_per_token`` at most
    expert_groups: int = 0
    groups_per_token: int = 0
    # a mixture's first ``dense_layers`` blocks have a dense MLP of width ``dense_ffn`` (DeepSeek's
    # ``first_k_dense_replace``): `dense_twin` is such a block's model
    dense_layers: int = 0
    dense_ffn: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("transformer", "mlp"):
            raise ValueError(f"unknown model kind {self.kind!r}")
        if self.layers < 1 or self.hidden < 1:
            raise ValueError(f"a model needs layers and width >= 1, got {self.layers} and {self.hidden}")
        if self.kind == "transformer" and self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} heads do not divide into {self.kv_heads} key/value heads")

    def __hash__(self) -> int:
        """The fields' hash, computed once: a search's caches are keyed by the model, millions of times."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}  # another process hashes anew

    # --- shapes --------------------------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        if self.kv_lora:
            return latent_attention.attention_width(self.heads, self.head_dim, self.rope_dim, self.v_head_dim)
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        if self.kv_lora:
            return self.q_dim
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @functools.cache  # noqa: B019
    def dense_twin(self) -> PaperModel | None:
        """The model whose every block is this mixture's dense first blocks (attention alike, an MLP of
        ``dense_ffn``); None when every block is alike."""
        if not (self.is_moe and self.dense_layers):
            return None
        return dataclasses.replace(
            self, experts=0, experts_per_token=0, shared_ffn=0, expert_groups=0, groups_per_token=0,
            ffn=self.dense_ffn, dense_layers=0, dense_ffn=0,
        )  # fmt: skip

    def dense_among(self, layers: range) -> int:
        """How many of ``layers`` (block indices) are dense first blocks."""
        if self.dense_twin() is None:
            return 0
        return len(range(max(layers.start, 0), min(layers.stop, self.dense_layers)))

    def _blocks_sum(self, per_block) -> float:
        """``per_block(model)`` summed over the blocks: the dense first ones by their twin."""
        twin = self.dense_twin()
        if twin is None:
            return self.layers * per_block(self)
        return (self.layers - self.dense_layers) * per_block(self) + self.dense_layers * per_block(twin)

    @functools.cache  # noqa: B019 (models are few and frozen; a search asks thousands of times)
    def gemms(self) -> list[Gemm]:
        """The matrix products of one layer's forward, per token, in the order the layer runs them: a
        Llama-shaped layer projects q, k and v apart and runs gate and up apart; a GPT-2-shaped one
        projects q, k, v in one product and has a single first MLP product."""
        h = self.hidden
        if self.kind == "mlp":
            return [Gemm("linear", h, h)]
        q, kv, ffn = self.q_dim, self.kv_dim, self.ffn
        if self.kv_lora:
            attention = [Gemm(role, k, n, split=split) for role, k, n, split in self._latent_products()]
        elif self.gated:
            attention = [Gemm("q", h, q), Gemm("k", h, kv), Gemm("v", h, kv), Gemm("o", q, h, split="k")]
        else:
            attention = [Gemm("qkv", h, q + 2 * kv), Gemm("o", q, h, split="k")]
        if not self.is_moe:
            return _alternate([*attention, *self._mlp(ffn, 1.0)])
        router = Gemm("router", h, self.experts, split="none")
        shared = self._mlp(self.shared_ffn, 1.0) if self.shared_ffn else []
        return _alternate([*attention, router, *self._mlp(ffn, float(self.experts_per_token)), *shared])

    def _latent_products(self) -> list[latent_attention.Product]:
        return latent_attention.products(
            self.hidden, self.heads, self.q_lora, self.kv_lora, self.head_dim, self.rope_dim, self.v_head_dim
        )

    def _mlp(self, width: int, count: float) -> list[Gemm]:
        h = self.hidden
        first = [Gemm("gate", h, width, count), Gemm("up", h, width, count)] if self.gated else [
            Gemm("fc1", h, width, count)
        ]  # fmt: skip
        return [*first, Gemm("down", width, h, count, split="k")]

    # --- parameters ----------------------------------------------------------------------------------

    @functools.cache  # noqa: B019
    def layer_parameters(self) -> int:
        """Parameters of one block (every expert of a mixture)."""
        h = self.hidden
        if self.kind == "mlp":
            return h * h
        q, kv = self.q_dim, self.kv_dim
        attention = h * (q + 2 * kv) + q * h
        attention += (q + 2 * kv if self.qkv_bias or self.linear_bias else 0) + (h if self.linear_bias else 0)
        if self.kv_lora:
            per_width = 2 if self.norm == "layer" else 1
            attention = sum(k * n for _, k, n, _ in self._latent_products())
            attention += latent_attention.norm_parameters(self.q_lora, self.kv_lora, per_width)
        up = 2 if self.gated else 1
        expert = h * up * self.ffn + self.ffn * h + ((up * self.ffn + h) if self.linear_bias else 0)
        if self.is_moe:
            mlp = self.experts * expert + h * self.experts
            if self.shared_ffn:  # the shared expert, and its gate
                mlp += h * up * self.shared_ffn + self.shared_ffn * h + h
        else:
            mlp = expert
        return attention + mlp + 2 * self.norm_parameters()

    def norm_parameters(self) -> int:
        return self.hidden * (2 if self.norm == "layer" else 1)

    def embedding_parameters(self) -> int:
        if self.kind == "mlp":
            return 0
        return (self.vocab + self.positions) * self.hidden

    def head_parameters(self) -> int:
        """The final norm and the vocabulary projection (a copy of the embedding's when tied: a stage
        without the embedding holds one)."""
        if self.kind == "mlp":
            return 0
        return self.norm_parameters() + self.vocab * self.hidden

    def parameters(self) -> int:
        """The whole model's parameters, a tied matrix counted once."""
        tied = self.vocab * self.hidden if self.tied else 0
        blocks = self._blocks_sum(PaperModel.layer_parameters)
        total = blocks + self.embedding_parameters() + self.head_parameters()
        return total - tied

    # --- FLOPs ---------------------------------------------------------------------------------------

    def layer_gemm_flops(self) -> float:
        """Forward FLOPs of one layer's matrix products, per token (2 per multiply-add)."""
        return sum(2.0 * g.k * g.n * g.count for g in self.gemms())

    def head_gemm_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab if self.kind == "transformer" else 0.0

    def attention_flops(self, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs of one layer's attention (scores and weighted sum), per token: 4 s q_dim, halved
        for causal attention, whose kernels skip the masked half."""
        if self.kind == "mlp":
            return 0.0
        span = (seq_len + 1) / 2 if causal else seq_len
        return 4.0 * span * self.q_dim

    def model_flops_per_token(self, seq_len: int) -> float:
        """The FLOPs that MFU counts per token of training: 6 x the matrix parameters a token uses (the
        head included, the embedding's lookup not) + 12 x layers x q_dim x seq_len for attention (the
        whole square, as PaLM, Megatron-LM and torchtitan count it), recompute never counted."""
        matrices = self._blocks_sum(PaperModel.layer_gemm_flops) / 2 + self.head_gemm_flops() / 2
        attention = 12.0 * self.layers * self.q_dim * seq_len if self.kind == "transformer" else 0.0
        return 6.0 * matrices + attention

    def __str__(self) -> str:
        if self.kind == "mlp":
            return f"{self.name} ({self.layers} layers of width {self.hidden:,}, like ShardedMLP)"
        moe = f", {self.experts} experts (top {self.experts_per_token})" if self.is_moe else ""
        gqa = f", {self.kv_heads} kv heads" if self.kv_heads != self.heads else ""
        return (
            f"{self.name} ({self.layers} layers, width {self.hidden:,}, {self.heads} heads{gqa}, "
            f"FFN {self.ffn:,}{moe}, vocab {self.vocab:,})"
        )


def _alternate(gemms: list[Gemm]) -> list[Gemm]:
    """Mark every other product (the first, the third...) as kept under selective recompute; a router,
    whose output is tiny, is always kept and not counted."""
    marked, number = [], 0
    for gemm in gemms:
        if gemm.role == "router":
            marked.append(gemm)
            continue
        marked.append(Gemm(gemm.role, gemm.k, gemm.n, gemm.count, gemm.split, kept=number % 2 == 0))
        number += 1
    return marked


def gpt_model(dim: int, layers: int, heads: int, vocab: int) -> PaperModel:
    """pipeclock's own GPT (``pipeclock.models.gpt``): LayerNorms, biased Linears, a 4 x dim GELU MLP,
    rotary positions, the head tied to the embedding."""
    if dim % heads:
        raise ValueError(f"GPT dim {dim} is not divisible by heads {heads}")
    return PaperModel(
        f"GPT {layers} blocks x {dim}", layers, dim, heads, heads, dim // heads, 4 * dim, vocab,
        gated=False, tied=True, norm="layer", linear_bias=True,
    )  # fmt: skip


def mlp_model(parameters: int, layers: int) -> PaperModel:
    """A ShardedMLP-shaped stack of ``layers`` square Linear layers totalling about ``parameters``."""
    hidden = max(1, round(math.sqrt(parameters / layers)))
    return PaperModel(f"a {_short(parameters)}-parameter model", layers, hidden, kind="mlp")


def _short(number: float) -> str:
    for name, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.3g}{name}"
    return str(number)
