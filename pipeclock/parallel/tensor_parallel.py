"""Tensor parallel inside a pipeline stage: torch's ``parallelize_module`` applied to a rank's chunks.

A plan says which modules to split and how, in ``transformers``' format (``base_model_tp_plan``): a
module path, ``*`` standing for any one name, mapped to a style name. Each style is one of torch's own
``ParallelStyle``s:

    colwise                          ColwiseParallel(): the weight's rows (output features) split, the
                                     input replicated, each rank's output its own slice
    rowwise                          RowwiseParallel(): the weight's columns split, each rank's input its
                                     slice, the outputs all-reduced (replicated)
    colwise_rep, colwise_gather_output   ColwiseParallel(output_layouts=Replicate()): the slices gathered
    rowwise_split_input, rowwise_rep RowwiseParallel(input_layouts=Replicate()): each rank takes its slice
    embedding_rowwise                RowwiseParallel(input_layouts=Replicate()) on an embedding: the
                                     vocabulary split, the looked-up rows all-reduced
    embedding_colwise                ColwiseParallel(output_layouts=Replicate()) on an embedding
    per_head                         pipeclock's own: a norm's weight [heads, head_dim] split with the
                                     heads (`per_head`), for Cohere's use_qk_norm
    replicate, replicated_with_grad_allreduce   the module left whole on every rank; fed a slice (between a
                                     column split and its row split), its gradient summed over tp
    moe_tp_experts                   transformers' experts module, its weights split as their own
                                     patterns say (packed_colwise, rowwise, ...): `tp_experts`

Parameters of a split module become DTensors over the mesh's ``"tp"`` dim; every other module stays
whole on each tp rank. Outside the split regions it sees the same (replicated) inputs and gradients on
every one of them, so its gradient is one device's with no sum; inside one, `tp_layouts` sums it or
refuses the plan. The styles ``transformers`` writes that have no counterpart here (``NOT_TRANSLATED``)
are refused by name. ``SequenceParallel`` is not offered: see docs/three-axes.md.

A plan is checked before anything is split, on every rank alike: a style torch has no counterpart for,
a pattern that names no module of the model (on any stage), a module that is no ``nn.Linear`` or
``nn.Embedding``, a split that ``tp`` does not divide, a tied weight split one way at one end and
another way (or not at all) at the other. Each is one line; nothing has run yet.

Weights tied across stages (``engine.ties``) are split alike at both ends, so summing the tie's
gradients shard by shard is summing whole; a weight two modules of one rank share stays one tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from pipeclock import comms
from pipeclock.engine.ties import tie, tie_key
from pipeclock.parallel import tp_experts, tp_layouts
from pipeclock.parallel.per_head import PerHead

Plan = Mapping[str, str]

STYLES: dict[str, Callable[[], ParallelStyle] | None] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicate": None,
    "replicated_with_grad_allreduce": None,
    "per_head": PerHead,
    tp_experts.EXPERTS: None,  # built from the weights' styles: tp_experts.ExpertsParallel
}
# transformers' styles that have no torch ParallelStyle here, each with why
NOT_TRANSLATED = {
    "packed_colwise": "a fused weight (gate and up stacked) outside a moe_tp_experts module: each rank "
    "needs its slice of each half, which a contiguous column split does not give",
    "packed_rowwise": "a fused weight read by halves, outside a moe_tp_experts module",
    "moe_identity_expert": "experts split by tp (give them to ranks with --ep instead)",
    "sequence_parallel": "sequence parallel is not offered (docs/three-axes.md)",
    "local_params": "parameters kept local to each rank, outside DTensor",
    "local_colwise": "a column split kept outside DTensor",
    "local_rowwise": "a row split kept outside DTensor",
    "local_packed_rowwise": "a fused weight read by halves",
    "local": "a module kept outside DTensor",
    "mla_kv_a_proj": "a multi-head latent attention projection split in parts",
    "all_reduce": "a module whose output is each rank's partial sum",
    "ep_router": "experts split over ranks (use --ep)",
    "grouped_gemm": "experts split over ranks (use --ep)",
    "gather": "a gathered module of expert parallelism (use --ep)",
}
COLUMN_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "embedding_colwise")


@dataclass(frozen=True)
class Split:
    """One module the plan splits: where it is, how, and which of its weight's dims is cut."""

    chunk: int
    name: str
    module: nn.Module
    style: str

    @property
    def dim(self) -> int:
        """The weight dim split: a Linear's rows for a column split, its columns for a row split; an
        Embedding stores its matrix the other way round (rows are the vocabulary)."""
        column = self.style in COLUMN_STYLES
        return int(column) if isinstance(self.module, nn.Embedding) else int(not column)

    def layout(self, parameter: str) -> str:
        """The tp layout of the module's ``parameter`` once split: ``Shard(d)`` or ``Replicate``."""
        if parameter == "bias" and self.style not in COLUMN_STYLES:
            return "Replicate"  # a row split adds its bias once, after the sum
        return f"Shard({0 if parameter == 'bias' else self.dim})"

    def what(self, size: int) -> str:
        if isinstance(self.module, nn.Embedding):
            return f"{size} {'rows (the vocabulary)' if self.dim == 0 else 'columns'}"
        return f"{size} {'output' if self.dim == 0 else 'input'} features"


def tensor_parallel(
    chunks: Sequence[nn.Module], mesh: DeviceMesh, plan: Plan, source: str = "the plan"
) -> list[nn.Module]:
    """Split this rank's ``chunks`` over the mesh's ``"tp"`` dim as ``plan`` says, in place; every rank
    calls it, together (the checks gather every rank's findings). ``source`` names the plan in errors
    (``--tp-plan FILE``, or the model's own). Returns the chunks.

    The tp ranks of a stage compute one result together: give each of them its replica's batch, the
    same inputs and targets (different ones would leave each rank a wrong gradient); a ``Pipeline`` of
    the chunks checks it every step and refuses a batch that differs.
    """
    chunks = list(chunks)
    tp_mesh = mesh["tp"]
    tp = tp_mesh.size()
    if tp == 1:
        return chunks
    plan, experts = tp_experts.weight_styles(dict(plan))
    _check_styles(plan, source)
    splits = list(_resolve(chunks, plan))
    _agree_on_the_plan(chunks, plan, splits, tp, source, experts)
    shared = _shared_slots(chunks)
    for split in splits:
        style = STYLES[split.style]
        if split.style == tp_experts.EXPERTS:
            weights = tp_experts.layout(split.module, _weight_styles(split, experts), tp, split.name)
            parallelize_module(split.module, tp_mesh, tp_experts.ExpertsParallel(weights))
        elif style is not None:
            parallelize_module(split.module, tp_mesh, style())
    _restore_shared(shared)
    for index, chunk in enumerate(chunks):
        for parameter in chunk.parameters():
            if isinstance(parameter, DTensor):
                parameter.register_post_accumulate_grad_hook(_gradient_laid_out_as_parameter)
        styles = {id(s.module): (s.name, s.style) for s in splits if s.chunk == index}
        tp_layouts.watch(chunk, styles, tp_mesh, source)
    return chunks


def _gradient_laid_out_as_parameter(parameter: DTensor) -> None:
    """Autograd may leave a split parameter's gradient in another layout than the parameter's (an
    embedding split by vocabulary gets a whole, replicated gradient): laid out as the parameter, each
    rank keeps only its own shard (for a replicated gradient, a slice: no message). The tie's sums, the
    gradient norm and the optimizer then see each rank's part of the one gradient."""
    grad = parameter.grad
    if isinstance(grad, DTensor) and grad.placements != parameter.placements:
        parameter.grad = grad.redistribute(parameter.device_mesh, parameter.placements)


def read_plan(path: str | Path) -> dict[str, str]:
    """A plan from a JSON file (``--tp-plan FILE``): one object mapping module patterns to style names.

    Raises ``ValueError`` (one line naming the file) for a file that cannot be read or is not such an
    object; the styles themselves are checked where the plan is applied.
    """
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"--tp-plan {path}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--tp-plan {path}: not JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(plan, dict) or not all(isinstance(v, str) for v in plan.values()) or not plan:
        raise ValueError(
            f"--tp-plan {path}: expected a JSON object of module patterns and style names, "
            '{"layers.*.mlp.up_proj": "colwise", ...}'
        )
    return plan


def _check_styles(plan: Plan, source: str) -> None:
    """The first pattern whose style pipeclock does not translate, refused with the style and why."""
    for pattern, style in plan.items():
        if style in STYLES:
            continue
        why = NOT_TRANSLATED.get(style, f"it knows {', '.join(STYLES)}")
        raise ValueError(
            f"rank {comms.get_rank()}: {source} asks for {style!r} at {pattern}, which pipeclock does not "
            f"translate to a torch ParallelStyle ({why})"
        )


def matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` is one ``pattern`` names: the same number of dotted parts, ``*`` any one."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch(n, p) for n, p in zip(names, parts, strict=True))


def _resolve(chunks: list[nn.Module], plan: Plan) -> Iterator[Split]:
    """Every module of the chunks that the plan names, with its style (the first pattern that fits)."""
    for index, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            style = next((plan[p] for p in plan if name and matches(p, name)), None)
            if style is not None:
                yield Split(index, name, module, style)


def _weight_styles(split: Split, experts: dict[str, dict[str, str]]) -> dict[str, str]:
    """The styles the plan gives the weights of the experts module ``split``."""
    return next((styles for pattern, styles in experts.items() if matches(pattern, split.name)), {})


def _problem(split: Split, tp: int, source: str, experts: dict[str, dict[str, str]]) -> str | None:
    """What is wrong with one split on this rank, or None."""
    if split.style == tp_experts.EXPERTS:
        found = tp_experts.layout(split.module, _weight_styles(split, experts), tp, split.name)
        return found if isinstance(found, str) else None
    if STYLES[split.style] is None:
        return None
    if split.style == "per_head":
        weight = getattr(split.module, "weight", None)
        if weight is None or weight.dim() != 2 or weight.shape[0] % tp:
            shape = None if weight is None else list(weight.shape)
            return f"--tp {tp} does not split {split.name}'s weight {shape} by heads (per_head)"
        return None
    if not isinstance(split.module, nn.Linear | nn.Embedding):
        return (
            f"{source} splits {split.name} ({split.style}), a {type(split.module).__name__}: "
            "only nn.Linear and nn.Embedding can be split"
        )
    size = split.module.weight.shape[split.dim]
    if size % tp:
        return f"--tp {tp} does not divide the {split.what(size)} of {split.name} ({split.style} splits them)"
    return None


def _tie_layouts(chunks: list[nn.Module], splits: list[Split]) -> dict[str, set[str]]:
    """How each tied weight held here would be laid out once split (``Whole`` where no split touches it)."""
    split_of = {id(s.module): s for s in splits if STYLES[s.style] is not None}
    layouts: dict[str, set[str]] = {}
    for chunk in chunks:
        for module in chunk.modules():
            for name, parameter in module.named_parameters(recurse=False):
                key = tie_key(parameter)
                if key is not None:
                    split = split_of.get(id(module))
                    layouts.setdefault(key, set()).add(split.layout(name) if split else "Whole")
    return layouts


def _agree_on_the_plan(
    chunks: list[nn.Module],
    plan: Plan,
    splits: list[Split],
    tp: int,
    source: str,
    experts: dict[str, dict[str, str]],
) -> None:
    """One gather over the world: every rank learns every rank's findings, and all refuse alike."""
    problems = [p for p in (_problem(s, tp, source, experts) for s in splits) if p is not None]
    used = sorted({p for s in splits for p in plan if matches(p, s.name)})
    found = (used, problems, _tie_layouts(chunks, splits))
    everyone = comms.all_gather_object(found, "agreeing on the tensor-parallel plan")
    rank = comms.get_rank()
    for owner, (_, problems, _) in enumerate(everyone):
        if problems:
            raise ValueError(f"rank {rank}: {problems[0]}" + (f" (on rank {owner})" if owner != rank else ""))
    named = {pattern for used, _, _ in everyone for pattern in used}
    missing = [pattern for pattern in plan if pattern not in named]
    if missing:
        raise ValueError(
            f"rank {rank}: {source} names {', '.join(missing)}, which the model does not have "
            f"(no module of any stage matches)"
        )
    ties: dict[str, set[str]] = {}
    for _, _, layouts in everyone:
        for key, seen in layouts.items():
            ties.setdefault(key, set()).update(seen)
    for key, seen in sorted(ties.items()):
        if len(seen) > 1:
            raise ValueError(
                f"rank {rank}: {source} splits the tied weight {key} differently where it is used "
                f"({', '.join(sorted(seen))}): split both ends alike, or neither"
            )


Slots = list[tuple[nn.Module, str]]


def _shared_slots(chunks: list[nn.Module]) -> list[tuple[Slots, str | None]]:
    """Each parameter's places (module, attribute) and tie mark, before the split replaces it."""
    places: dict[int, tuple[Slots, str | None]] = {}
    for chunk in chunks:
        for module in chunk.modules():
            for name, parameter in module.named_parameters(recurse=False):
                slots, _ = places.setdefault(id(parameter), ([], tie_key(parameter)))
                if (module, name) not in slots:
                    slots.append((module, name))
    return list(places.values())


def _restore_shared(shared: list[tuple[Slots, str | None]]) -> None:
    """A parameter that several modules shared is one tensor again (the first split one), and a tied
    weight's new tensor carries its mark: the split made new parameters, one per module."""
    for slots, key in shared:
        parameters = [getattr(module, name) for module, name in slots]
        kept = next((p for p in parameters if hasattr(p, "placements")), parameters[0])
        for module, name in slots:
            if getattr(module, name) is not kept:
                setattr(module, name, kept)
        if key is not None:
            tie(kept, key)
