"""What a training run's model costs per token, and what its GPU can do: the two figures MFU divides.

The FLOPs are the planner's paper model's (``PaperModel.model_flops_per_token``: 6 x the matrices a
token passes through plus attention, recompute never counted) for the model ``train`` builds; a
ShardedMLP sample is one token. The peak is the GPU table's dense figure for the run's dtype, for the
GPU torch names (None for a kind the table does not know, and off a GPU).
"""

from __future__ import annotations

from pipeclock.plan.gpus import GIB, KINDS, GpuKind
from pipeclock.plan.paper_model import PaperModel, gpt_model


def paper_model_of(config, task) -> PaperModel:
    """The paper model of the model ``config`` trains (``task``: the run's, for its vocabulary)."""
    if config.model == "mlp":
        return PaperModel(f"ShardedMLP {config.layers} x {config.hidden}", config.layers, config.hidden,
                          kind="mlp")  # fmt: skip
    if config.model == "gpt":
        return gpt_model(config.dim, config.layers, config.heads, task.gpt.vocab_size)
    from pipeclock.plan.hf_paper import paper_model

    return paper_model(task.hf_config)


def flops_per_token(config, task) -> float | None:
    """Model FLOPs of training on one token; None for a model the paper model cannot describe."""
    try:
        model = paper_model_of(config, task)
    except ValueError:  # a Hugging Face model that is not shaped like a causal LM's config says
        return None
    return model.model_flops_per_token(1 if config.model == "mlp" else config.seq_len)


def gpu_kind(name: str, memory_bytes: int) -> GpuKind | None:
    """The table's kind for a device ``torch.cuda.get_device_name`` calls ``name``, with that memory."""
    squeezed = name.upper().replace(" ", "").replace("-", "")
    for kind in KINDS.values():
        model, _, size = kind.name.upper().partition("-")
        if model.replace("-", "") not in squeezed:
            continue
        if size and abs(memory_bytes / GIB - int(size.removesuffix("GB"))) > 8:
            continue  # an A100 of the other memory size
        return kind
    return None


def device_peak(device, dtype: str) -> float | None:
    """Peak dense FLOP/s of ``device`` in ``dtype``; None off a GPU or for a kind the table lacks."""
    if device.type != "cuda":
        return None
    import torch

    properties = torch.cuda.get_device_properties(device)
    kind = gpu_kind(properties.name, properties.total_memory)
    return kind.peak(dtype) if kind else None
