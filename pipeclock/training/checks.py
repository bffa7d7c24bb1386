"""A run's configuration, checked before anything starts: sane values, and every rank asking the same.

Each rank reads its own command line. Two ranks started with different ``--layers`` would build models
that do not fit together, and different ``--steps`` would leave one rank waiting in a collective the
others never join: so before the first step every rank shares its whole configuration and all refuse,
naming each rank's values, if any differ. Values that cannot work (``--steps 0``, ``--timeout -1``)
and flags that cannot work together (a batch too small for ``--dp`` x ``--microbatches``) are one
clear error, not a traceback from deep inside; an error found while the run is set up names its rank.
Once it runs, a loss that is not a finite number stops it (``check_loss``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields

from pipeclock import comms
from pipeclock.engine.precision import DTYPES
from pipeclock.engine.recompute import POLICY_HELP, parse_policy
from pipeclock.training.expert_checks import check_expert_parallel
from pipeclock.training.lr_schedule import check_schedule
from pipeclock.training.optimizer import check_optimizer

AT_LEAST_ONE = (
    "microbatches",
    "hidden",
    "layers",
    "dim",
    "heads",
    "seq_len",
    "eval_batches",
    "batch_size",
    "steps",
)
AT_LEAST_ZERO = ("eval_every", "checkpoint_every", "seed")
POSITIVE = ("timeout", "lr")


def check_values(config) -> None:
    """``ValueError`` naming the flag for the first value that cannot work."""
    for name in AT_LEAST_ONE:
        _at_least(name, getattr(config, name), 1)
    for name in AT_LEAST_ZERO:
        _at_least(name, getattr(config, name), 0)
    for name in POSITIVE:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{_flag(name)} must be > 0, got {value}")
    if config.chunks is not None:
        _at_least("chunks", config.chunks, 1)
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {config.dropout}")
    try:
        parse_policy(config.recompute)
    except ValueError:
        raise ValueError(f"--recompute must be {POLICY_HELP}, got {config.recompute!r}") from None
    if config.dtype not in DTYPES:
        raise ValueError(f"--dtype must be {' or '.join(DTYPES)}, got {config.dtype!r}")
    _check_data_parallel(config)
    check_optimizer(config)
    check_schedule(config)


def _check_data_parallel(config) -> None:
    _at_least("dp", config.dp, 1)
    _check_tensor_parallel(config)
    check_expert_parallel(config)
    if config.data_parallel not in ("fsdp", "ddp"):
        raise ValueError(f"--data-parallel must be fsdp or ddp, got {config.data_parallel!r}")
    if config.clip_grad_norm is not None and not config.clip_grad_norm > 0:
        raise ValueError(f"--clip-grad-norm must be > 0, got {config.clip_grad_norm}")
    smallest_shard = config.batch_size // config.dp
    if config.dp > 1 and smallest_shard < config.microbatches:
        raise ValueError(
            f"--batch-size {config.batch_size} is the global batch: split over --dp {config.dp} replicas, "
            f"a replica gets {smallest_shard} sample(s), fewer than --microbatches {config.microbatches} "
            f"(use a batch of at least {config.dp * config.microbatches})"
        )


def _check_tensor_parallel(config) -> None:
    _at_least("tp", config.tp, 1)
    _at_least("tp_timed_steps", config.tp_timed_steps, 0)
    if config.tp_plan is not None and config.tp == 1:
        raise ValueError(f"--tp-plan {config.tp_plan} needs --tp N with N > 1 (the ranks that share a stage)")
    if config.tp > 1 and config.dp > 1 and config.data_parallel == "ddp":
        raise ValueError(
            "--data-parallel ddp cannot hold tensor-parallel parameters (DTensors): use fsdp with --tp"
        )


def check_world(config, world: int) -> None:
    """What needs the number of processes: ``--dp`` x ``--tp`` divides them into equal pipelines."""
    if config.tp == 1 and world % config.dp:
        raise ValueError(
            f"--dp {config.dp} does not divide the {world} process(es) into equal pipelines "
            f"(processes = dp x pp): use a --dp that divides {world}"
        )
    if world % (config.dp * config.tp):
        raise ValueError(
            f"--dp {config.dp} x --tp {config.tp} = {config.dp * config.tp} does not divide the {world} "
            f"process(es) into equal pipelines (processes = dp x pp x tp): use a dp x tp that divides {world}"
        )


def agree(config) -> None:
    """Every rank runs the same configuration, or every rank raises the same ``ValueError``.

    The gather has the run's timeout (the process group's), so a rank that never gets here is a
    ``CommTimeoutError`` naming the others, not a hang.
    """
    mine = {f.name: getattr(config, f.name) for f in fields(config)}
    everyone = comms.all_gather_object(mine, "agreeing on the run's configuration")
    differing = [name for name in mine if any(other[name] != everyone[0][name] for other in everyone)]
    if differing:
        described = "; ".join(
            _who_has_what(_flag(name), [values[name] for values in everyone]) for name in differing
        )
        raise ValueError(f"rank {comms.get_rank()}: ranks disagree on the run: {described}")


def _who_has_what(flag: str, values: list) -> str:
    """``--layers is 8 on rank 0 and 6 on ranks 1, 2``: each value once, with the ranks that have it."""
    ranks_of: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks_of.setdefault(
            repr(value) if isinstance(value, str) or value is None else str(value), []
        ).append(rank)
    parts = [f"{value} on {_ranks(ranks)}" for value, ranks in ranks_of.items()]
    return f"{flag} is " + ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def check_loss(loss: float, step: int) -> None:
    """Stop on a loss that is not a finite number, before the optimizer step spreads it to the weights.

    The loss is the global batch's, the same float on every rank, so every rank stops at the same step;
    nothing after it (optimizer step, checkpoint) runs, so no checkpoint holds the poisoned weights.
    """
    if not math.isfinite(loss):
        raise LossNotFiniteError(
            f"rank {comms.get_rank()}: the loss is {loss} at step {step}; stopped before that step's "
            f"optimizer step, so the weights and any checkpoint hold only the {step} step(s) before it "
            "(lower --lr, or bound the updates with --clip-grad-norm)"
        )


class LossNotFiniteError(ValueError):
    """The training loss became NaN or infinite: the run cannot go on."""


def named(text: str, rank: int) -> str:
    """``text`` with ``rank R:`` first, unless it names a rank already."""
    return text if text.startswith("rank ") else f"rank {rank}: {text}"


@contextmanager
def naming_the_rank() -> Iterator[None]:
    """A ``ValueError`` raised while the run is set up names the rank that raised it."""
    try:
        yield
    except ValueError as error:
        error.args = (named(str(error), comms.get_rank()),)
        raise


def _at_least(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_flag(name)} must be a whole number >= {minimum}, got {value!r}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
