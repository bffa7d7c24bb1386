"""The models ``pipeclock plan`` can judge: the built-in ones, measured here, or a rough one by size.

A rough model (``--params N``) is too large to build, so its layers are described, not measured: the
course's ShardedMLP scaled up, ``layers`` square Linear layers of ``N / layers`` parameters each (no
bias), whose activations follow the MLP's pattern (each layer saves its input, its ReLU its output) and
whose times are counted in forwards of one layer (B = 2 F, split I = W = F). Its optimizer is taken to
update in place (fused), with no temporaries: torch's unfused Adam would add two copies of a layer's
matrix.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from pipeclock.observe.sizes import format_bytes
from pipeclock.plan.layer_cost import LayerCost
from pipeclock.plan.rank_memory import Training, held_parameters

MODEL_BATCH_SIZES = {"mlp": 128, "gpt": 16, "hf": 16, "params": 128}


@dataclass(frozen=True)
class PlannedModel:
    name: str
    layers: list[LayerCost]
    batch_size: int
    time_unit: str  # "ms" when measured, "layer forwards" for a rough model
    note: str
    time_scale: float = 1.0  # shown times = the layers' times x this (1000: seconds shown in ms)

    @property
    def parameters(self) -> int:
        return held_parameters(self.layers)  # the whole model: a tied matrix once


def rough_layers(parameters: int, num_layers: int, samples: int) -> list[LayerCost]:
    """``num_layers`` equal Linear(h, h) layers (no bias, so 10e9 over 16 layers is exactly a width of
    25,000) with ReLUs, totalling about ``parameters``; one micro-batch of ``samples`` samples; times in
    forwards of one layer."""
    hidden = max(1, round(math.sqrt(parameters / num_layers)))
    each = hidden * hidden
    tensor = samples * hidden * 4
    layers = []
    for index in range(num_layers):
        last = index == num_layers - 1
        layers.append(
            LayerCost(
                name=str(index),
                kind="last" if last else "layer",
                samples=samples,
                parameters=each,
                forward=1.0,
                backward=2.0,
                input_grad=1.0,
                weight_grad=1.0,
                held=0,
                keeps_input=tensor,
                keeps_output=0 if last else tensor,
                input_bytes=tensor,
                output_bytes=tensor,
                message_bytes=tensor,
                weight_held=2 * tensor,
                workspace=tensor,  # a backward's gradient of its input
                loss_held=0,
                unmetered=0,
                largest_parameter=0,  # a fused optimizer step: no temporaries
                keeps_graph=False,
            )
        )
    return layers


def model_layers(args: argparse.Namespace) -> PlannedModel:
    """The layers of the model the command line describes, for one micro-batch size (see `for_samples`)."""
    if args.params is not None:
        parameters = _parameters(args.params)
        num_layers = args.layers or 16
        _at_least_one(num_layers, "--layers")
        batch = args.batch_size or MODEL_BATCH_SIZES["params"]
        _at_least_one(batch, "--batch-size")
        layers = rough_layers(parameters, num_layers, batch)
        hidden = round(math.sqrt(parameters / num_layers))
        note = f"{num_layers} layers of width {hidden:,}, like ShardedMLP"
        unit = "forwards of one layer over the batch"
        return PlannedModel(f"a {_short(parameters)}-parameter model", layers, batch, unit, note)
    return _measured(args)


def _measured(args: argparse.Namespace) -> PlannedModel:
    import torch

    from pipeclock.models.gpt import GPTConfig
    from pipeclock.plan.model_specs import gpt_spec, mlp_spec
    from pipeclock.plan.profile import profile

    torch.set_num_threads(max(1, args.threads))
    batch = args.batch_size or MODEL_BATCH_SIZES[args.model]
    _at_least_one(batch, "--batch-size")
    if args.model == "hf":
        spec = _hf_spec(args)
    elif args.model == "gpt":
        layers = args.layers or 4
        config = GPTConfig(args.vocab, args.dim, layers, args.heads, args.seq_len)
        spec = gpt_spec(config)
    else:
        layers = args.layers or 16
        _at_least_one(layers, "--layers")
        spec = mlp_spec(args.hidden, layers)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # where it will run
    measured = profile(spec, batch, dtype=args.dtype, device=device)  # the whole batch: scaled to each size
    where = f"{args.threads} thread(s)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    note = f"layers measured here on {where}, batch {batch}"
    return PlannedModel(spec.name, measured, batch, "ms", note, time_scale=1e3)


def _hf_spec(args: argparse.Namespace):
    """A Hugging Face config's pieces (``--hf-config PATH``: a config.json or a directory holding one)."""
    import warnings

    from pipeclock.models import hf
    from pipeclock.plan.model_specs import hf_spec

    if not args.hf_config:
        raise ValueError("--model hf needs --hf-config PATH (a config.json, or a directory holding one)")
    if args.layers is not None:
        raise ValueError("--layers does not apply to --model hf: the config says how many layers it has")
    config = hf.config_of(args.hf_config)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.seq_len > positions:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's {positions} positions")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a conversion to float32 master weights: training says it
        return hf_spec(config, args.seq_len)


def describe_model(model: PlannedModel, training: Training, device: int, binary: bool) -> str:
    return (
        f"pipeclock plan: {model.name} ({model.note}; {model.parameters:,} parameters), {training.dtype}, "
        f"{training.optimizer}, batch {model.batch_size}, devices of {format_bytes(device, binary)}"
    )


def _parameters(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--params takes a number of parameters like 10e9 or 1.3e9, got {text!r}") from None
    if not value >= 1 or math.isinf(value):
        raise ValueError(f"--params must be at least 1, got {text!r}")
    return round(value)


def _at_least_one(value: int, option: str) -> None:
    if value < 1:
        raise ValueError(f"{option} must be a whole number >= 1, got {value}")


def _short(number: int) -> str:
    for name, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if number >= size:
            return f"{number / size:.3g}{name}"
    return str(number)
