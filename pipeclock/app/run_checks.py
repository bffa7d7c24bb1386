"""A run's configuration, checked before anything starts: sane values, and every rank asking the same.

Each rank reads its own command line. Two ranks started with different ``--layers`` would build models
that do not fit together, and different ``--steps`` would leave one rank waiting in a collective the
others never join: so before the first step every rank shares its whole configuration and all refuse,
naming each rank's values, if any differ. Values that cannot work (``--steps 0``, ``--timeout -1``)
are one clear error, not a traceback from deep inside.
"""

from __future__ import annotations

from dataclasses import fields

from pipeclock import comms
from pipeclock.engine.precision import DTYPES
from pipeclock.engine.recompute import POLICY_HELP, parse_policy

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


def _check_data_parallel(config) -> None:
    _at_least("dp", config.dp, 1)
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


def agree(config) -> None:
    """Every rank runs the same configuration, or every rank raises the same ``ValueError``."""
    mine = {f.name: getattr(config, f.name) for f in fields(config)}
    everyone = comms.all_gather_object(mine, "agreeing on the run's configuration")
    differing = sorted({name for other in everyone for name in mine if other[name] != everyone[0][name]})
    if differing:
        described = "; ".join(
            f"{_flag(name)}: " + ", ".join(f"rank {r} {values[name]!r}" for r, values in enumerate(everyone))
            for name in differing
        )
        raise ValueError(
            f"rank {comms.get_rank()}: the ranks were started with different settings ({described})"
        )


def _at_least(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_flag(name)} must be a whole number >= {minimum}, got {value!r}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
