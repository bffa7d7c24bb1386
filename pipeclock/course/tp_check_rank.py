"""One rank of ``pipeclock lab 12 --check FILE``: the learner's split Linears held to one process.

The rank joins a gloo group, loads the learner's file and goes through `PHASES` in order: build each
split from the whole layer (its parameters are checked to be this rank's slice), run each one alone
forward and backward on inputs and gradients taken from one process's MLP (`tp_reference`), then the
two together as that MLP with its loss. A barrier follows each phase, so every rank is always in the
same one. The first thing found wrong is one line naming this rank and, where the numbers say which,
the missing reduction (a partial product never summed, a gradient summed twice or not at all, a bias
added on every rank); the rank reports it to the checker (`tp_check`) through a queue and leaves.
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeclock.course.learner_file import line_by_line
from pipeclock.course.tp_collectives import Collectives, Misused
from pipeclock.course.tp_reference import WIDTH, Reference, close, how_far, scale, share, span

CLASSES = ("ColumnParallelLinear", "RowParallelLinear")
PHASES = (
    "building ColumnParallelLinear",
    "building RowParallelLinear",
    "ColumnParallelLinear's forward",
    "ColumnParallelLinear's backward",
    "RowParallelLinear's forward",
    "RowParallelLinear's backward",
    "the MLP's forward (column, ReLU, row)",
    "the MLP's backward",
)
GROUP_TIMEOUT = 120.0  # seconds; the checker stops a stuck rank well before


class Wrong(Exception):
    """What a rank found wrong, as the line to print."""


def load_module(path: Path) -> ModuleType:
    """The learner's file at ``path``, imported."""
    spec = importlib.util.spec_from_file_location(f"learner_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_classes(path: Path, module: ModuleType | None = None) -> dict[str, type]:
    """The learner's two classes from the file at ``path``; `LookupError` when one is missing."""
    module = module or load_module(path)
    missing = [name for name in CLASSES if not isinstance(getattr(module, name, None), type)]
    if missing:
        raise LookupError(f"{path} defines no class {' or '.join(missing)}")
    return {name: getattr(module, name) for name in CLASSES}


@dataclass(frozen=True)
class Split:
    """How one of the two classes cuts its layer: by output features (dim 0), or by input ones (dim 1)."""

    name: str
    layer: nn.Linear
    dim: int

    @property
    def column(self) -> bool:
        return self.dim == 0

    def weight(self, rank: int, world: int) -> torch.Tensor:
        part = share(self.layer.weight.shape[self.dim], rank, world)
        return self.layer.weight.detach()[part] if self.column else self.layer.weight.detach()[:, part]

    def bias(self, rank: int, world: int) -> torch.Tensor:
        bias = self.layer.bias.detach()
        return bias[share(len(bias), rank, world)] if self.column else bias

    def rule(self, rank: int, world: int) -> str:
        part = span(share(self.layer.weight.shape[self.dim], rank, world))
        layout = "nn.Linear's (out_features, in_features) weight"
        if self.column:
            return f"a column split keeps rows (the output features, dim 0 of {layout}), here rows {part}"
        return f"a row split keeps columns (the input features, dim 1 of {layout}), here columns {part}"


class RankCheck:
    """This rank's side of the check: runs the phases, reports to ``events``."""

    def __init__(self, rank: int, world: int, learner: Path, events) -> None:
        self.rank, self.world, self.learner, self.events = rank, world, learner.resolve(), events
        self.reference = Reference()
        self.phase = 0

    def put(self, kind: str, *rest) -> None:
        self.events.put((kind, self.rank, *rest))

    def enter(self, phase: int) -> None:
        self.phase = phase
        self.put("phase", phase)

    def passed(self) -> None:
        """The phase is over on this rank: wait for the others at a barrier."""
        self.put("waits", self.phase)
        dist.barrier()

    def call(self, function, *args):
        """The learner's ``function(*args)``; an exception is the fault, with its line in their file."""
        try:
            return function(*args)
        except Misused as error:
            raise self.wrong(str(error)) from None
        except Exception as error:
            raise Wrong(f"rank {self.rank} raised {describe_exception(error, self.learner)}") from None

    def backward(self, output: torch.Tensor, grad: torch.Tensor, what: str) -> None:
        if not output.requires_grad:
            raise self.wrong(f"{what} carries no gradient back: nothing in its forward may be detached")
        self.call(lambda: (output * grad).sum().backward())  # the gradient of output is grad

    def wrong(self, text: str) -> Wrong:
        return Wrong(f"rank {self.rank}: {text}")

    # --- the phases --------------------------------------------------------------------------------------

    def run(self) -> None:
        module = load_module(self.learner)
        Collectives(self.learner, lambda: PHASES[self.phase]).install(module)
        classes = load_classes(self.learner, module)
        ref, rank, world = self.reference, self.rank, self.world
        splits = Split(CLASSES[0], ref.up, 0), Split(CLASSES[1], ref.down, 1)
        built = []
        for phase, split in enumerate(splits):
            self.enter(phase)
            layer = self.call(classes[split.name], copy.deepcopy(split.layer), rank, world)
            self.check_parameters(layer, split)
            built.append(layer)
            self.passed()
        column, row = built
        self.check_column(column, splits[0])
        self.check_row(row, splits[1])
        self.check_mlp(column, row, splits)

    def check_column(self, column: nn.Module, split: Split) -> None:
        ref, rows = self.reference, share(WIDTH, self.rank, self.world)
        self.enter(2)
        x = ref.x.clone().requires_grad_()
        h = self.call(column, x)
        self.check_column_output(h, ref.h.detach()[:, rows], rows)
        self.passed()
        self.enter(3)
        forget_gradients(column)
        self.backward(h, ref.h.grad[:, rows], f"{split.name}'s output")
        own = ref.h.grad[:, rows] @ split.weight(self.rank, self.world)  # this rank's features' part alone
        self.check_input_gradient(x.grad, ref.x_grad, own, split.name)
        self.check_gradients(column, split)
        self.passed()

    def check_row(self, row: nn.Module, split: Split) -> None:
        ref, columns = self.reference, share(WIDTH, self.rank, self.world)
        self.enter(4)
        a = ref.a.detach()[:, columns].clone().requires_grad_()
        y = self.call(row, a)
        partial = a.detach() @ split.weight(self.rank, self.world).T
        self.check_row_output(y, partial, split)
        self.passed()
        self.enter(5)
        forget_gradients(row)
        self.backward(y, ref.y.grad, f"{split.name}'s output")
        self.check_summed_once(a.grad, ref.a.grad[:, columns], f"the gradient of {split.name}'s input")
        self.check_gradients(row, split)
        self.passed()

    def check_mlp(self, column: nn.Module, row: nn.Module, splits: tuple[Split, Split]) -> None:
        ref = self.reference
        self.enter(6)
        forget_gradients(column, row)
        x = ref.x.clone().requires_grad_()
        y = self.call(lambda: row(F.relu(column(x))))
        self.expect(y, ref.y, "the MLP's output")
        loss = F.mse_loss(y, ref.target)
        self.passed()
        self.enter(7)
        self.call(loss.backward)
        self.expect(x.grad, ref.x_grad, "the gradient of the MLP's input")
        self.check_gradients(column, splits[0])
        self.check_gradients(row, splits[1])
        self.passed()

    # --- what is compared ----------------------------------------------------------------------------------

    def check_parameters(self, layer: nn.Module, split: Split) -> None:
        for name, want in (
            ("weight", split.weight(self.rank, self.world)),
            ("bias", split.bias(self.rank, self.world)),
        ):
            got = getattr(layer, name, None)
            where = f"{split.name}.{name}"
            if not isinstance(got, nn.Parameter):
                what = "is missing" if got is None else f"is a {type(got).__name__}, not an nn.Parameter"
                raise self.wrong(f"{where} {what}: keep this rank's share as self.{name} = nn.Parameter(...)")
            if got.shape != want.shape:
                raise self.wrong(self.shape_text(where, name, got, want, split))
            if not close(got, want):
                raise self.wrong(self.values_text(where, name, got, split))

    def shape_text(self, where: str, name: str, got: torch.Tensor, want: torch.Tensor, split: Split) -> str:
        whole = tuple(getattr(split.layer, name).shape)
        shown = (
            f"{where} has shape {tuple(got.shape)}, this rank's share of the {whole} {name} is "
            f"{tuple(want.shape)}"
        )
        if name == "bias":
            kept = f"its outputs' {want.shape[0]}" if split.column else "all of it, added once after the sum"
            return f"{shown}: a {'column' if split.column else 'row'} split keeps {kept}"
        other = Split(split.name, split.layer, 1 - split.dim).weight(self.rank, self.world)
        if got.shape == other.shape:
            return f"{shown} (yours cuts the other dim): {split.rule(self.rank, self.world)}"
        if got.dim() == 2 and got.shape[1 - split.dim] == want.shape[1 - split.dim]:
            return f"{shown}: {self.uneven(split, got.shape[split.dim], want.shape[split.dim])}"
        return f"{shown}: {split.rule(self.rank, self.world)}"

    def uneven(self, split: Split, kept: int, due: int) -> str:
        """The right dim, the wrong count: an uneven or off-by-one share."""
        whole = split.layer.weight.shape[split.dim]
        what = ("rows", "output features") if split.column else ("columns", "input features")
        part = span(share(whole, self.rank, self.world))
        return (
            f"the right dim, an uneven share: rank {self.rank} keeps {kept} {what[0]} where each rank keeps "
            f"{due} ({whole} / {self.world}); split the {whole} {what[1]} in {self.world} equal parts, "
            f"here {what[0]} {part}"
        )

    def values_text(self, where: str, name: str, got: torch.Tensor, split: Split) -> str:
        if name == "weight" or split.column:
            for owner in range(self.world):
                theirs = (
                    split.weight(owner, self.world) if name == "weight" else split.bias(owner, self.world)
                )
                if owner != self.rank and close(got, theirs):
                    rule = split.rule(self.rank, self.world)
                    return f"{where} holds rank {owner}'s share, not rank {self.rank}'s: {rule}"
        want = split.weight(self.rank, self.world) if name == "weight" else split.bias(self.rank, self.world)
        return (
            f"{where} {how_far(got, want)}: take it from the layer given, {split.rule(self.rank, self.world)}"
        )

    def check_column_output(self, h, want: torch.Tensor, rows: slice) -> None:
        name = CLASSES[0]
        whole = self.reference.h
        if isinstance(h, torch.Tensor) and h.shape == whole.shape and h.shape != want.shape:
            raise self.wrong(
                f"{name}'s output has all {whole.shape[1]} features, shape {tuple(h.shape)}: a column split "
                f"returns this rank's own (features {span(rows)}, shape {tuple(want.shape)})"
            )
        self.expect(h, want, f"{name}'s output (features {span(rows)})")

    def check_input_gradient(self, got, want: torch.Tensor, own: torch.Tensor, name: str) -> None:
        if isinstance(got, torch.Tensor) and not close(got, want) and close(got, own):
            raise self.wrong(
                f"the gradient of {name}'s input is this rank's part alone (through its own features): the "
                "column split's backward must sum it over the ranks (all_reduce in SumGradientsOverRanks's "
                "backward)"
            )
        self.expect(got, want, f"the gradient of {name}'s input")

    def check_row_output(self, y, partial: torch.Tensor, split: Split) -> None:
        ref, bias = self.reference, split.layer.bias.detach()
        if (
            isinstance(y, torch.Tensor)
            and not close(y, ref.y)
            and (close(y, partial + bias) or close(y, partial))
        ):
            raise self.wrong(
                f"{split.name}'s output is this rank's partial product alone: its forward must sum the "
                "ranks' partial products (all_reduce in SumOverRanks's forward), then add the bias"
            )
        if isinstance(y, torch.Tensor) and not close(y, ref.y) and close(y, ref.y + (self.world - 1) * bias):
            raise self.wrong(
                f"{split.name}'s output holds the bias {self.world} times: every rank adds it before the "
                "sum; add it once, after the all_reduce"
            )
        self.expect(y, ref.y, f"{split.name}'s output")

    def check_summed_once(self, got, want: torch.Tensor, what: str) -> None:
        factor = scale(got, want) if isinstance(got, torch.Tensor) else None
        if factor is not None and abs(factor - self.world) < 1e-3:
            raise self.wrong(
                f"{what} is {self.world} times one process's: the row split's sum also summed the "
                "gradient on its way back (as torch.distributed.nn.functional.all_reduce does); it is "
                "already whole on every rank, so SumOverRanks's backward passes it on unchanged"
            )
        self.expect(got, want, what)

    def check_gradients(self, layer: nn.Module, split: Split) -> None:
        for name in ("weight", "bias"):
            parameter = getattr(layer, name)
            want = split_gradient(split, name, getattr(split.layer, name).grad, self.rank, self.world)
            self.check_summed_once(parameter.grad, want, f"the gradient of {split.name}.{name}")

    def expect(self, got, want: torch.Tensor, what: str) -> None:
        if got is None:
            raise self.wrong(f"{what} is None: no gradient reached it (is it used, and not detached?)")
        if not isinstance(got, torch.Tensor):
            raise self.wrong(f"{what} is a {type(got).__name__}, not a tensor")
        if got.shape != want.shape:
            raise self.wrong(f"{what} has shape {tuple(got.shape)}, one process's has {tuple(want.shape)}")
        if not close(got, want):
            raise self.wrong(f"{what} {how_far(got, want)}")


def split_gradient(split: Split, name: str, whole: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's share of a whole parameter's gradient, cut as the split cuts the parameter."""
    if name == "bias":
        return whole[share(len(whole), rank, world)] if split.column else whole
    part = share(whole.shape[split.dim], rank, world)
    return whole[part] if split.column else whole[:, part]


def forget_gradients(*layers: nn.Module) -> None:
    for layer in layers:
        for parameter in layer.parameters():
            parameter.grad = None


def describe_exception(error: BaseException, learner: Path) -> str:
    """``ValueError: ... (line 12 of FILE: `code`)``: the learner's deepest line in the traceback."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == learner]
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    if not frames:
        return text
    frame = frames[-1]
    return f"{text} (line {frame.lineno} of {os.path.relpath(learner)}: `{(frame.line or '').strip()}`)"


def run_rank(rank: int, world: int, store: str, learner: str, events) -> None:
    """A process's whole life: join the group, check every phase, leave. After a fault it waits to be
    stopped by the checker: a rank that left would break the connections its peers are still waiting
    on, and their errors would be news of this one, not faults of their own."""
    with open(os.devnull, "w") as quiet:
        os.dup2(quiet.fileno(), 2)  # torch's warnings and gloo's complaints when a peer is stopped
    line_by_line()
    torch.set_num_threads(1)
    check = RankCheck(rank, world, Path(learner), events)
    try:
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timeout
        )
        check.put("started")
        check.run()
        check.put("finished")
    except Wrong as wrong:
        check.put("fault", check.phase, str(wrong))
        wait_to_be_stopped(events)
    except Exception as error:  # a failure of the check itself, or of the group: still one line
        check.put("fault", check.phase, f"rank {rank}: {type(error).__name__}: {error}".splitlines()[0])
        wait_to_be_stopped(events)
    events.close()
    events.join_thread()  # the report is out before the process ends
    sys.stdout.flush()
    os._exit(0)


def wait_to_be_stopped(events) -> None:
    events.close()
    events.join_thread()  # the fault is out
    while True:
        time.sleep(60)
