"""Expert parallel's all-to-alls in the simulator: charged inside each action, hidden in DualPipeV's pairs.

An action through MoE layers exchanges tokens with its expert group: before each MoE block the dispatch
sends each token to the ranks of its experts, after it the combine brings the results back (a backward
runs the two again, reversed). ``exchange(rank, action)`` gives those seconds for one action, on top of
its compute. A lone action pays both, one after the other: its compute waits for its tokens. An
overlapped pair (DualPipeV's forward of one micro-batch with the backward of another, an ``F`` marked
``overlap`` and the backward after it) runs the two streams at once, one micro-batch's all-to-all
while the other computes, as DeepSeek-V3's DualPipe does: the pair takes the longer of its two
computes together and its two exchanges together, ``max(cF + cB, xF + xB)``; what is left of the
exchanges past the computes is charged to the backward, which ends the pair.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeclock.engine.actions import Action
from pipeclock.engine.program import Instruction, Program, lower

PerAction = Callable[[int, Action], float]


@dataclass(frozen=True)
class ExchangeTime:
    """A step's all-to-all seconds, summed over ranks: all of them, and the share left exposed."""

    total: float
    exposed: float

    @property
    def hidden(self) -> float:
        """The share of the all-to-all time that ran under another micro-batch's compute."""
        return 1.0 - self.exposed / self.total if self.total else 0.0


def paired(program: Program) -> dict[int, int]:
    """In ``program``, each overlapped pair as {index of its forward: index of its backward}."""
    pairs, computes = {}, [n for n, i in enumerate(program) if i.is_compute]
    for first, second in itertools.pairwise(computes):
        forward, backward = program[first], program[second]
        if forward.kind == "F" and forward.action is not None and forward.action.overlap and (
            backward.kind in ("B", "I")
        ):  # fmt: skip
            pairs[first] = second
    return pairs


def charged(
    programs: Sequence[Program], compute: PerAction, exchange: PerAction
) -> tuple[PerAction, ExchangeTime]:
    """Each compute action's duration with its all-to-alls (the module's rule), and the step's all-to-all
    time, total and exposed."""
    durations: list[dict[Action, float]] = []
    total = exposed = 0.0
    for rank, program in enumerate(programs):
        pairs = paired(program)
        seconds: dict[Action, float] = {}
        skip: set[int] = set()
        for index, instruction in enumerate(program):
            if not instruction.is_compute or index in skip:
                continue
            cost, sent = compute(rank, instruction.action), exchange(rank, instruction.action)
            if index not in pairs:
                seconds[instruction.action] = cost + sent
                total, exposed = total + sent, exposed + sent
                continue
            partner = program[pairs[index]]
            skip.add(pairs[index])
            other, other_sent = compute(rank, partner.action), exchange(rank, partner.action)
            left = max(0.0, sent + other_sent - cost - other)
            seconds[instruction.action], seconds[partner.action] = cost, other + left
            total, exposed = total + sent + other_sent, exposed + left
        durations.append(seconds)
    return (lambda rank, action: durations[rank][action]), ExchangeTime(total, exposed)


def exchange_time(schedule, costs: PerAction, exchange: PerAction) -> ExchangeTime:
    """The step's all-to-all time, total and exposed, when ``schedule`` runs with these costs (the
    program `pipeclock.observe.simulate.simulate` runs: a file's, else the lowering's)."""
    programs = getattr(schedule, "programs", None) or lower(schedule)
    return charged(programs, costs, exchange)[1]


# --- the program, as printed ------------------------------------------------------------------------

WORDS = {
    "A2A_F": "the forward's all-to-alls with the ep group: tokens to their experts before each MoE "
    "block, results back after it",
    "A2A_B": "the backward's all-to-alls with the ep group: the same two, reversed",
}


def all_to_all_word(instruction: Instruction, peers: Sequence[int]) -> str | None:
    """The all-to-all a compute instruction runs inside, with the ep group's other ranks:
    ``1A2A_F0<->4,8,12``; None for an instruction that runs none (a ``W``, a message)."""
    if instruction.kind not in ("F", "B", "I"):
        return None
    kind = "A2A_F" if instruction.kind == "F" else "A2A_B"
    return f"{instruction.stage}{kind}{instruction.microbatch}<->{','.join(map(str, peers))}"


def ep_peers(coordinates: Sequence[tuple[int, int, int]], layout, ep: int) -> list[list[int]]:
    """For each global rank at ``coordinates[rank]`` = (dp, pp, tp) of ``layout``, the other ranks of its
    expert group: the same stage and tp rank in the ep - 1 replicas next to it (``d // ep`` alike)."""
    replicas = layout.shape[0]
    return [
        [int(layout[other, s, t]) for other in range(replicas) if other // ep == d // ep and other != d]
        for d, s, t in coordinates
    ]
