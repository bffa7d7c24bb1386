"""Will it fit, and how fast will it go? Per-rank memory and step time of a pipeline, before running it.

The memory is ``pipeclock.plan.rank_memory``'s: weights, gradients and optimizer state per parameter,
and what the micro-batches hold along the rank's own order of actions. The step time is the simulator's,
fed with each stage's own costs. Everything is a pure function of the per-layer costs (`LayerCost`,
measured by ``pipeclock.plan.profile`` or made up for a model too large to build), so the same
numbers come out on any machine and are easy to check by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeclock.engine.actions import Action, Schedule, join_first_stage_backwards, placement_of
from pipeclock.engine.generators import chunks_of, generate, get_schedule, supports_chunks
from pipeclock.engine.program import Instruction
from pipeclock.models.partition import cut_by_stage_cost, partition, partition_by_cost
from pipeclock.observe.simulate import Link, simulate
from pipeclock.observe.timeline import Timeline
from pipeclock.plan.layer_cost import LayerCost
from pipeclock.plan.rank_memory import RankMemory, Training, rank_memory, stage_bytes

BALANCES = ("layers", "time", "memory")


# --- a whole plan: the cut, the memory per rank, the step time ----------------------------------------


@dataclass(frozen=True)
class Plan:
    """One configuration, judged: its cut, each rank's memory, and the simulated step."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    training: Training
    balance: str
    cut: tuple[range, ...]
    memory: tuple[RankMemory, ...]
    step_time: float | None = None  # None until simulated
    bubble: float | None = None

    @property
    def peak(self) -> int:
        return max(rank.total for rank in self.memory)

    def fits(self, device_memory: int) -> bool:
        return self.peak <= device_memory


def cut_for(
    layers: Sequence[LayerCost],
    num_virtual: int,
    balance: str,
    training: Training = Training(),
    table: Schedule | None = None,
) -> list[range]:
    """The model's cut into ``num_virtual`` stages: by layer count, by time (F + B), or by memory.

    By memory, a stage weighs its static bytes (weights, gradients, optimizer state) plus its
    activations times the micro-batches it holds at once under ``table`` (one each without a table):
    1F1B's first stage holds p micro-batches and its last one, so the first gets fewer layers.
    """
    if balance == "layers":
        return partition(len(layers), num_virtual)
    if balance == "time":
        return partition_by_cost([layer.forward + layer.backward for layer in layers], num_virtual)
    if balance == "memory":
        per_parameter = training.bytes_per_parameter
        held = in_flight(table) if table is not None else [1] * num_virtual

        def weight(stage: int, part: range) -> float:
            chosen = [layers[i] for i in part]
            activations = held[stage] * stage_bytes(chosen, training).forward
            return per_parameter * sum(x.parameters for x in chosen) + activations

        return cut_by_stage_cost(len(layers), num_virtual, weight)
    raise ValueError(f"unknown balance {balance!r}: use {', '.join(BALANCES)}")


def in_flight(table: Schedule) -> list[int]:
    """Per virtual stage: the most micro-batches it holds at once (its F done, its backward not)."""
    placement = placement_of(table)
    most = [0] * placement.num_virtual
    for rank, actions in enumerate(table):
        live = [0] * placement.num_virtual
        for action in actions:
            stage = placement.stage(rank, action.chunk)
            if action.op == "F":
                live[stage] += 1
                most[stage] = max(most[stage], live[stage])
            elif action.op in ("B", "W"):
                live[stage] -= 1
    return most


def step_time(
    layers: Sequence[LayerCost],
    cut: Sequence[range],
    table: Schedule,
    training: Training = Training(),
    link: Link = Link(),
    action_overhead: float = 0.0,
) -> Timeline:
    """The simulated step (a ``Timeline``) of the program the engine runs: each action costs what its
    stage's layers cost, plus ``action_overhead``, the engine's own time per action (its Python,
    posting and waiting on messages), which no layer profile sees; each message what ``link`` says
    for the bytes that cross that stage boundary.

    F is the sum of the layers' forwards; B their backwards (I + W where the engine splits them); with
    recompute, a backward first runs the recomputed layers' forwards again.
    """
    placement = placement_of(table)
    per_stage = [_stage_times([layers[i] for i in part], training) for part in cut]
    boundary = [layers[part[-1]].message_bytes for part in cut]  # what stage s hands to s + 1

    def cost(rank: int, action: Action) -> float:
        return per_stage[placement.stage(rank, action.chunk)][action.op] + action_overhead

    def message_bytes(send: Instruction) -> float:
        assert send.stage is not None
        return boundary[send.stage if send.kind == "SEND_F" else send.stage - 1]

    as_run = join_first_stage_backwards(table)  # what the engine runs: a first-stage I and W as one B
    return simulate(as_run, cost, link.latency, link.bandwidth, message_bytes)


def _stage_times(layers: Sequence[LayerCost], training: Training) -> dict[str, float]:
    recompute = training.recompute
    again = sum(x.forward for i, x in enumerate(layers) if recompute.full or recompute.checkpointed(i))
    return {
        "F": sum(x.forward for x in layers),
        "B": again + sum(x.backward for x in layers),
        "I": again + sum(x.input_grad for x in layers),
        "W": sum(x.weight_grad for x in layers),
    }


def judge(
    layers: Sequence[LayerCost],
    schedule: str,
    stages: int,
    microbatches: int,
    training: Training = Training(),
    balance: str = "layers",
    simulated: bool = True,
    cut: Sequence[range] | None = None,
    action_overhead: float = 0.0,
    runtime_memory: int = 0,
    link: Link = Link(),
) -> Plan:
    """One configuration's cut (``balance``'s, unless ``cut`` is given) and memory (each rank holding
    ``runtime_memory`` beside its model's), and (``simulated``) its step time and bubble (each action
    costing ``action_overhead`` more than its layers, each message what ``link`` says)."""
    chunks = chunks_of(schedule) or (2 if supports_chunks(get_schedule(schedule)) else 1)
    table = generate(schedule, stages, microbatches, chunks)
    num_virtual = placement_of(table).num_virtual
    cut = list(cut) if cut is not None else cut_for(layers, num_virtual, balance, training, table)
    memory = rank_memory(layers, cut, table, training, runtime_memory)
    plan = Plan(schedule, stages, microbatches, chunks, training, balance, tuple(cut), tuple(memory))
    if not simulated:
        return plan
    timeline = step_time(layers, cut, table, training, link, action_overhead)
    return replace(plan, step_time=timeline.makespan, bubble=timeline.bubble_share)
