"""Per-layer costs, measured on one process: each layer's F, B, I and W time, and the bytes it holds.

A cut by layer count assumes every layer costs the same; a GPT's embedding costs almost nothing and its
head (a vocabulary-wide matrix and the loss) can cost several blocks. So a cut by time or by memory
needs each layer's own cost. This module measures them the way the engine runs them: the forward under
the same saved-tensor accounting as ``ActivationMeter``, the backward whole or split into I and W with
the engine's own functions, the last layer with the loss.

Only a few layers exist at a time (the memory wall: the profile must not need the whole model). Layers
built alike (every block of a GPT, every hidden layer of the MLP) are measured once, timed on up to
``ALIKE`` of them in turn as a stage runs them, with the output of the previous kind as input; the
model's first layer is always measured on its own (its input wants no gradient, so its backward does
less). Identical layers then cost exactly the same, so a cut by time follows the model's real
differences, never the noise of a busy machine.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from pipeclock.engine import pytree
from pipeclock.engine.backward import (
    ParameterOutputs,
    backward_input,
    backward_weight,
    backward_whole,
    held_tensors,
    in_place_saves_enough,
)
from pipeclock.engine.memory import is_parameter_cast
from pipeclock.engine.precision import Precision, parse_precision
from pipeclock.engine.recompute import apply_recompute
from pipeclock.engine.ties import tie_key
from pipeclock.plan.cuda_memory import rounded
from pipeclock.plan.layer_cost import LayerCost
from pipeclock.plan.model_specs import ModelSpec

ALIKE = 4  # layers of one kind timed in turn (at most): enough to leave the caches as a stage does


def profile(
    spec: ModelSpec,
    samples: int,
    repeats: int = 5,
    warmup: int = 2,
    dtype: str = "fp32",
    device: torch.device | None = None,
) -> list[LayerCost]:
    """Every layer's costs for micro-batches of ``samples`` samples, each kind of layer measured once,
    one layer alive at a time: the least time of ``repeats`` runs after ``warmup`` runs (on a shared
    machine noise only ever adds time, and the cut needs the layers' costs relative to each other).

    With ``dtype="bf16"`` the forwards run under autocast, as the engine runs them: what a layer saves
    is then partly bf16 and partly float32 (what autocast keeps in float32), which no fixed ratio of the
    float32 sizes predicts, and the times are bf16's. Everything is measured on ``device`` (default: the
    CPU), where the layers and the batch are put: a GPU's times and its allocator's bytes.
    """
    precision, device = parse_precision(dtype), device or torch.device("cpu")
    inputs, targets = (pytree.tree_map(lambda t: t.to(device), part) for part in spec.batch(samples))
    measured: dict[tuple[str, bool], LayerCost] = {}
    flowing = inputs
    for index in range(spec.num_layers):
        kind, key = spec.kind(index), _measured_as(spec, index)
        if key in measured:
            continue
        alike = [i for i in range(index, spec.num_layers) if _measured_as(spec, i) == key][:ALIKE]
        layers = [spec.build(i).to(device) for i in alike]
        last = index == spec.num_layers - 1
        feed = _Feed(flowing, targets if last else None, spec.loss_fn, index == 0, precision, device)
        cost, flowing = _measure(layers, feed, repeats, warmup)
        *checkpointed, weight_held = _checkpointed_saves(layers[0], feed)
        measured[key] = replace(
            cost,
            kind=kind,
            samples=samples,
            checkpointed=tuple(checkpointed),
            weight_held_checkpointed=weight_held,
            dtype=dtype,
            cuda_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        )
        del layers
    return [replace(measured[_measured_as(spec, i)], name=spec.layer_name(i)) for i in range(spec.num_layers)]


def _measured_as(spec: ModelSpec, index: int) -> tuple[str, bool]:
    """Which measurement layer ``index`` shares: its kind's, but the model's first layer always has its
    own. Its input is the batch, which wants no gradient, so its backward skips the input's gradient (for
    a Linear, a matrix product as large as its forward): measured for the rest of its kind, it would make
    every later layer's backward look several times cheaper than it is."""
    return spec.kind(index), index == 0


@dataclass(frozen=True)
class _Feed:
    """What a layer is run on: its input, the targets (for the last layer, which computes the loss), the
    loss, whether it is the model's first layer (whose input wants no gradient), and the precision."""

    given: object
    targets: object
    loss_fn: Callable
    first: bool
    precision: Precision
    device: torch.device


Located = set[tuple[int, int]]  # (data pointer, bytes): how the meter tells tensors apart


def _measure(alike: list[nn.Module], feed: _Feed, repeats: int, warmup: int):
    """The costs of a layer like those of ``alike``, and its output (detached) to feed the next kind.

    Times are measured as a stage runs its layers: the forwards of ``alike`` one after another, then
    their backwards in reverse, averaged. A layer whose backward follows its own forward at once finds
    its weights and activations still in cache, which in a stage of several it never does (on 2 cores
    the MLP's 1024 x 1024 backward runs 20-25 % faster so). Under bf16 the weights are cast once for
    all the runs, as the engine casts them once per step for all its micro-batches.
    """
    captures = [ParameterOutputs([layer]) for layer in alike]
    samples: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    with feed.precision.step_region(feed.device):  # bf16: weights cast once, as in a step
        for run in range(warmup + repeats):
            for split in (False, True):
                forwards = [
                    _forward(x, feed, c, accumulate=True) for x, c in zip(alike, captures, strict=True)
                ]
                saves = in_place_saves_enough(forwards[0].captured)  # the same for every pass
                passes = [_backward(done, split) for done in reversed(forwards)]
                if run >= warmup:
                    for op in samples.keys() & passes[0].times.keys():
                        samples[op].append(sum(p.times[op] for p in passes) / len(passes))
    for layer in alike:
        layer.zero_grad(set_to_none=True)
    layer, capture = alike[0], captures[0]
    parameters = {p.data_ptr() for p in layer.parameters()}
    peak = _one_pass(layer, feed, capture, split=False).times["peak"]
    record = _one_pass(layer, feed, capture, split=True)
    sizes = _sizes(record, parameters, feed.device)
    gradients = sum(p.numel() * p.element_size() for p in layer.parameters())
    kept = sizes["held"] + sizes["output_bytes"] + sizes["loss_held"] + gradients
    workspace = max(0, round(peak) - kept)
    keeps_graph = capture.keeps_graph
    whole = min(samples["B"])
    split_total = min(samples["I"]) + min(samples["W"])
    cost = LayerCost(
        largest_parameter=max((p.numel() * p.element_size() for p in layer.parameters()), default=0),
        name="",
        kind="",
        samples=0,
        parameters=sum(p.numel() for p in layer.parameters()),
        tied=tuple(sorted({(key, p.numel()) for p in layer.parameters() if (key := tie_key(p))})),
        forward=min(samples["F"]),
        backward=split_total if capture.split_pays and saves else whole,  # the engine's unsplit B
        input_grad=min(samples["I"]),
        weight_grad=min(samples["W"]),
        keeps_graph=keeps_graph,
        workspace=workspace,
        parameter_slack=sum(rounded(p.nbytes) - p.nbytes for p in layer.parameters())
        if feed.device.type == "cuda"
        else 0,
        **sizes,
    )
    return cost, pytree.tree_map(lambda t: t.detach(), record.output)


@dataclass
class _Pass:
    output: object
    inputs: list[torch.Tensor]
    saved: list[tuple[int, int]]
    loss_saved: list[tuple[int, int]]
    targets: list[torch.Tensor]
    kept: list[torch.Tensor]  # every tensor F keeps for B: saved by autograd or captured by the engine
    held_after_input_grad: list[torch.Tensor]
    times: dict[str, float]


def _one_pass(
    layer: nn.Module, feed: _Feed, capture: ParameterOutputs, split: bool, accumulate: bool = False
) -> _Pass:
    """F, then B (or I and W when ``split``), timed.

    A received input is a fresh leaf that wants its gradient, as in the engine; the model's own input
    (``feed.first``) wants none. With ``accumulate`` the backward adds into the gradients already there, as
    every micro-batch but a step's first does in the engine: for a wide layer that read-add-write of
    the whole gradient costs as much as a third of the backward. Without it the gradients start empty
    (the memory is measured so, from nothing) and are dropped after.
    """
    return _backward(_forward(layer, feed, capture, accumulate), split)


@dataclass
class _Forwarded:
    """A layer's forward, timed, and what its backward needs."""

    layer: nn.Module
    feed: _Feed
    capture: ParameterOutputs
    accumulate: bool
    fed: object
    inputs: list[torch.Tensor]
    output: object
    roots: list[torch.Tensor]
    grads: list[torch.Tensor] | None
    captured: list
    saved: list[tuple[int, int]]
    loss_saved: list[tuple[int, int]]
    kept: list[torch.Tensor]
    base: int
    times: dict[str, float]


def _forward(layer: nn.Module, feed: _Feed, capture: ParameterOutputs, accumulate: bool) -> _Forwarded:
    wants_grad = (lambda t: False) if feed.first else pytree.carries_gradient
    fed = pytree.tree_map(lambda t: t.detach().clone().requires_grad_() if wants_grad(t) else t, feed.given)
    parameter_ids = {id(p) for p in layer.parameters()}
    inputs = [leaf for leaf in pytree.gradient_leaves(fed) if leaf.requires_grad]
    saved: list[tuple[int, int]] = []
    loss_saved: list[tuple[int, int]] = []
    kept: list[torch.Tensor] = []

    def into(found: list[tuple[int, int]], tensors: list[torch.Tensor] | None = None):
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if is_parameter_cast(
                tensor, parameter_ids
            ):  # a bf16 copy of a weight: the model, as for the meter
                return tensor
            found.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
            if tensors is not None:
                tensors.append(tensor.detach())
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    if not accumulate:
        layer.zero_grad(set_to_none=True)
    base = _memory.start(feed.device)
    start = _now(feed.device)
    autocast = feed.precision.autocast(feed.device)
    with into(saved, kept), capture.capture() as captured, autocast:
        output = layer(fed)
    kept += [t for c in captured for t in (c.input, c.output) if t is not None]
    if feed.targets is not None:
        with into(loss_saved), feed.precision.autocast(feed.device):
            roots, grads = [feed.loss_fn(feed.precision.for_loss(output), feed.targets)], None
    else:
        roots = [leaf for leaf in pytree.gradient_leaves(output) if leaf.requires_grad]
        grads = [torch.ones_like(leaf) for leaf in roots]
    times = {"F": _now(feed.device) - start}
    return _Forwarded(
        layer,
        feed,
        capture,
        accumulate,
        fed,
        inputs,
        output,
        roots,
        grads,
        captured,
        saved,
        loss_saved,
        kept,
        base,
        times,
    )


def _backward(done: _Forwarded, split: bool) -> _Pass:
    times, held, device = done.times, [], done.feed.device
    start = _now(device)
    if split:
        with done.capture.rebuilding(done.captured):  # a checkpointed layer's modules hand their inputs over
            _, work = backward_input(
                done.roots, done.grads, done.inputs, done.captured, done.capture.keeps_graph
            )
        times["I"] = _now(device) - start
        held = held_tensors(work)
        start = _now(device)
        backward_weight(work)
        times["W"] = _now(device) - start
    else:
        backward_whole(done.roots, done.grads, done.inputs)
        times["B"] = _now(device) - start
        times["peak"] = _memory.peak(device) - done.base
    if not done.accumulate:
        done.layer.zero_grad(set_to_none=True)
    targets = pytree.leaves(done.feed.targets) if done.feed.targets is not None else []
    fed = pytree.leaves(done.fed)
    return _Pass(done.output, fed, done.saved, done.loss_saved, targets, done.kept, held, times)


def _checkpointed_saves(layer: nn.Module, feed: _Feed) -> tuple[int, int, int, int]:
    """What ``layer`` saves in its forward once the engine checkpoints it as one block (``every-1``),
    and what W then keeps: (held, keeps_input, keeps_output, weight_held). Done last: the checkpoint
    wraps the layer in place."""
    recomputed = apply_recompute([layer], "every-1")
    parameters = {p.data_ptr() for p in layer.parameters()}
    record = _one_pass(layer, feed, ParameterOutputs([layer], recomputed), split=True)
    sizes = _sizes(record, parameters, feed.device)
    return sizes["held"], sizes["keeps_input"], sizes["keeps_output"], sizes["weight_held"]


def _sizes(record: _Pass, parameters: set[int], device: torch.device) -> dict[str, int]:
    """What the layer holds, by the meter's rule; on a GPU each tensor as the allocator rounds it."""
    block = rounded if device.type == "cuda" else (lambda nbytes: nbytes)

    def located(tensors) -> Located:
        return {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}

    inputs, outputs = located(record.inputs), located(pytree.leaves(record.output))
    saved = {item for item in record.saved if item[0] not in parameters}
    new_outputs = outputs - inputs

    def total(items: Located) -> int:
        return sum(block(nbytes) for _, nbytes in items)

    targets = located(record.targets)
    loss_saved = {item for item in record.loss_saved if item[0] not in parameters} - outputs - targets
    held = total(saved - inputs - outputs)
    return {
        "unmetered": max(0, _storage_bytes(record, parameters) - held),
        "loss_held": total(loss_saved),
        "held": held,
        "keeps_input": total(saved & inputs),
        "keeps_output": total(saved & new_outputs),
        "input_bytes": total(inputs),
        "output_bytes": total(new_outputs),
        "message_bytes": total(outputs),
        "weight_held": total(located(record.held_after_input_grad)),
        "weight_extra": total(located(record.held_after_input_grad) - saved - inputs - outputs),
    }


def _storage_bytes(record: _Pass, parameters: set[int]) -> int:
    """The whole storages behind what F keeps, those of its inputs, outputs and parameters excepted:
    a saved view keeps its whole base alive, and the meter counts only the view."""

    def storages(tensors) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    kept = storages(record.kept)
    skip = set(storages(record.inputs)) | set(storages(pytree.leaves(record.output))) | parameters
    return sum(nbytes for pointer, nbytes in kept.items() if pointer not in skip)


class _Memory:
    """The most memory allocated since ``start``: CUDA's own counter on a GPU, or on a CPU the kernel's
    resident high-water mark (Linux), which sees large temporaries once the allocator returns freed
    blocks to the system (set ``MALLOC_MMAP_THRESHOLD_``); elsewhere 0."""

    _status = Path("/proc/self/status")

    def start(self, device: torch.device) -> int:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return torch.cuda.memory_allocated(device)
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        return self._read("VmRSS")

    def peak(self, device: torch.device) -> int:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device)
        return self._read("VmHWM")

    def _read(self, field: str) -> int:
        try:
            match = re.search(rf"^{field}:\s+(\d+) kB", self._status.read_text(), re.MULTILINE)
        except OSError:
            return 0
        return int(match.group(1)) * 1024 if match else 0


_memory = _Memory()


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # a measurement: the kernels queued so far are the time
        torch.cuda.synchronize(device)
    return time.perf_counter()
