"""What one transformer layer keeps for its backward, per token, by recompute policy and implementation.

Counted tensor by tensor from what autograd saves (tests/test_cluster_formulas.py measures it on a
Hugging Face Llama on this CPU). Per layer and token, with ``a`` the bytes of an activation element:

- each of the two norms: eager RMSNorm keeps its input, the normalized values and its output (the next
  product's input), in fp32 when the model computes in fp32; under bf16 it keeps an fp32 copy of its
  input (4 bytes), the normalized values and the output (2 each). A LayerNorm, or a fused norm, keeps
  its input and its output.
- attention: the q, k, v it is given, its output and its log-sum-exp (fp32, one per head): flash-style
  kernels keep no sequence-square matrix.
- the MLP: SwiGLU eagerly keeps the gate's and the up projection's outputs, the gate's activation and
  their product (4 x ffn); fused, the two outputs and the product (3 x ffn); a plain MLP its hidden
  values before and after the activation (2 x ffn). A mixture keeps that for each expert a token uses.

Recompute: ``full`` keeps each layer's input only and runs the layer's forward again in its backward;
``selective-attention`` is Megatron-LM's (Korthikanti et al. 2022): the attention core (softmax of the
scores, its dropout, the product with v) runs again in the backward from the q, k, v kept; with a
flash-style kernel, which keeps no square anyway, that saves only the log-sum-exp, and without one it is
what keeps the square out of memory. ``selective-op`` is torchtitan's op-level policy: the layer keeps
its input, attention's output and the outputs of every other matrix product in the order it runs them
(`PaperModel.gemms`: q, v, gate and down of a Llama layer), and recomputes the rest, the other products
(k, o, up) and every elementwise operation, in its backward.

Transformer Engine's fp8 (``fp8``, one byte): each fp8 product keeps its input as the fp8 cast it
multiplied (``_Linear`` and ``_LayerNormLinear`` save ``inputmat`` and ``ln_out`` quantized, a tp rank's
share of the tokens under sequence parallel), so a norm's output, the MLP's last hidden values and the
attention output that the output projection reads are kept at one byte; the attention core, still bf16,
keeps its own bf16 copy of its output, and the norms' inputs and the MLP's first products (what the
activation function differentiates) stay bf16.

Tensor parallel divides the head-sized and FFN-sized tensors by tp (at least one key/value head per
rank); sequence parallel divides the width-sized ones too. Under sequence parallel a column-parallel
product multiplies its input gathered over the sequence: Megatron-LM keeps the sequence shard for the
backward and gathers it again there (``LinearWithGradAccumulationAndAsyncCommunication``,
megatron/core/tensor_parallel/layers.py), while torch's ``ColwiseParallel`` hands the gathered tensor to
the product, which keeps it (``Software.tp_gathered_inputs``): the attention's and the MLP's inputs, and
the head's, whole, at ``gathered`` bytes an element (torchao's ``Float8ColwiseParallel`` casts to
float8 before it gathers: one byte). The ShardedMLP keeps each layer's input and its ReLU's output.
"""

from __future__ import annotations

from pipeclock.plan.paper_model import Gemm, PaperModel

LSE_BYTES = 4  # attention's log-sum-exp, one fp32 per head and token


def norm_bytes(model: PaperModel, a: int, fused: bool, fp8: int | None = None) -> float:
    """What one norm keeps per token, in bytes; its output, the next product's input, at ``fp8`` bytes an
    element when that product keeps its input in fp8."""
    out = a if fp8 is None else fp8
    if fused or model.norm == "layer":
        return model.hidden * (a + out)
    return model.hidden * ((12.0 if a == 4 else 8.0) - a + out)


def layer_bytes(
    model: PaperModel,
    recompute: str,
    a: int,
    fused: bool = False,
    tp: int = 1,
    sp: bool = False,
    fp8: int | None = None,
    gathered: float = 0.0,
) -> float:
    """Bytes one layer keeps per token from its forward to its backward (see the module's list); ``fp8``:
    the bytes of an element that a product keeps of its input, when it keeps its fp8 cast (None: ``a``);
    ``gathered``: the bytes of an element of the inputs its products keep gathered (0: none kept)."""
    h = model.hidden
    width = tp if sp else 1  # what divides the width-sized tensors
    if model.kind == "mlp":
        return (2.0 if recompute != "full" else 1.0) * h * a / width
    if recompute == "full":
        return h * a / width
    kv, q = kv_width(model, tp), model.q_dim / tp
    lse = model.heads / tp * LSE_BYTES
    if recompute == "selective-attention":
        return layer_bytes(model, "none", a, fused, tp, sp, fp8, gathered) - lse
    if recompute == "selective-op":
        kept = sum(output_width(model, g, tp, sp) * g.count for g in model.gemms() if g.kept)
        return (h / width + kept + q) * a + lse
    last = a if fp8 is None else fp8  # what the last product of the MLP keeps of its input
    attention = (2.0 * q + 2.0 * kv) * a + lse
    if fp8 is not None:  # the output projection's own fp8 copy of the attention output
        attention += q * fp8
    routed = model.experts_per_token if model.is_moe else 1
    ffn = model.ffn / tp * routed + model.shared_ffn / tp
    mlp = ((2.0 if fused else 3.0) * a + last) * ffn if model.gated else (a + last) * ffn
    if model.is_moe:
        mlp += model.experts * 4  # the router's fp32 scores
    inputs = 2.0 * h * gathered if (sp and tp > 1) else 0.0  # the attention's and the MLP's, gathered
    return 2.0 * norm_bytes(model, a, fused, fp8) / width + attention + mlp + inputs


def kv_width(model: PaperModel, tp: int) -> float:
    """The key (or value) width on one tp rank: at least one head each."""
    return max(model.kv_dim / tp, model.head_dim)


def output_width(model: PaperModel, gemm: Gemm, tp: int, sp: bool) -> float:
    """How wide a product's output is on one tp rank (per token, per use)."""
    if gemm.split == "none":
        return gemm.n
    if gemm.split == "k":  # reduced over the tp ranks: whole, or split over tokens under sp
        return gemm.n / (tp if sp else 1)
    if gemm.role in ("k", "v"):
        return kv_width(model, tp)
    if gemm.role == "qkv":
        return model.q_dim / tp + 2 * kv_width(model, tp)
    return gemm.n / tp


def head_bytes(
    model: PaperModel, a: int, fused: bool = False, tp: int = 1, sp: bool = False, gathered: float = 0.0
) -> float:
    """What the head keeps per token: its norm's tensors, its product's input gathered over the sequence
    where the product keeps it (``gathered`` bytes an element, under sequence parallel), and the loss's
    fp32 log-probabilities over the vocabulary (split over tp by a vocabulary-parallel loss)."""
    if model.kind == "mlp":
        return 0.0
    kept = norm_bytes(model, a, fused) / (tp if sp else 1) + 4.0 * model.vocab / tp
    return kept + (model.hidden * gathered if (sp and tp > 1) else 0.0)


def head_backward_bytes(model: PaperModel, a: int, tp: int = 1) -> float:
    """The head's backward, per token, on top of what it kept: the gradient arriving at the
    log-probabilities and the one the log-softmax computes from it, both fp32, alive together; split over
    tp ranks, torch's vocabulary-parallel loss (``loss_parallel``) also holds the softmax it rebuilds from
    the log-probabilities, a third fp32 tensor (measured: 12 and 16 bytes a logit at the backward's peak,
    with the 4 kept)."""
    if model.kind == "mlp":
        return 0.0
    return (8.0 if tp == 1 else 12.0) * model.vocab / tp
