"""``train --balance layers|time|memory``: where the model is cut, the same on every rank.

By layer count every rank knows the cut without a word. By time or by memory the cut follows measured
per-layer costs (``pipeclock.plan.profile``), and timings differ from process to process: so rank 0
alone measures, one layer at a time (the profile never holds more than one layer, so it needs no more
memory than the stage rank 0 is about to build), cuts, and every rank takes rank 0's cut.
"""

from __future__ import annotations

import math

from pipeclock import comms
from pipeclock.engine.actions import placement_of
from pipeclock.plan.planner import BALANCES, cut_for
from pipeclock.plan.rank_memory import Training


def check_balance(balance: str) -> None:
    if balance not in BALANCES:
        raise ValueError(f"--balance must be one of {', '.join(BALANCES)}, got {balance!r}")


def stage_cut(config, table) -> list[range] | None:
    """The cut that ``config.balance`` asks for, for the schedule ``table`` (whose placement says how
    many virtual stages); None for the layer count (the models' own default cut)."""
    check_balance(config.balance)
    if config.balance == "layers":
        return None
    num_virtual = placement_of(table).num_virtual
    cut = _measured_cut(config, num_virtual, table) if comms.get_rank() == 0 else None
    cut = comms.all_gather_object(cut, "sharing rank 0's cut of the model")[0]
    if comms.get_rank() == 0:
        shown = " | ".join(f"{part.start}..{part.stop - 1}" for part in cut)
        by_count = _by_count(config, num_virtual)
        print(f"--balance {config.balance}: layers per stage {shown} (by count: {by_count})", flush=True)
    return cut


def _by_count(config, num_virtual: int) -> str:
    from pipeclock.models.partition import partition

    layers = _spec(config).num_layers
    return " | ".join(f"{part.start}..{part.stop - 1}" for part in partition(layers, num_virtual))


def _measured_cut(config, num_virtual: int, table) -> list[range]:
    from pipeclock.plan.profile import profile

    samples = math.ceil(config.batch_size / config.dp / config.microbatches)  # one replica's micro-batch
    training = Training(dtype=config.dtype)
    measured = profile(_spec(config), samples, dtype=config.dtype, device=comms.device())
    return cut_for(measured, num_virtual, config.balance, training, table)


def _spec(config):
    """The model ``config`` trains, as the profile builds it a piece at a time."""
    from pipeclock.models.gpt import GPTConfig
    from pipeclock.plan.model_specs import gpt_spec, hf_spec, mlp_spec

    if config.model == "hf":
        from pipeclock.training.hf_task import hf_source

        return hf_spec(hf_source(config), config.seq_len, config.seed)
    if config.model == "gpt":
        gpt = GPTConfig(
            dim=config.dim, layers=config.layers, heads=config.heads, seq_len=config.seq_len, seed=config.seed
        )
        return gpt_spec(gpt)
    return mlp_spec(config.hidden, config.layers, config.seed)
