"""What to measure: the cases of a sweep, and which torch schedule runs the same order as ours.

A case is one (stages, hidden, micro-batches, schedule). Both engines run it on the same modules, so the
torch schedule of a case must be the one whose per-rank order of F, B (and W) equals pipeclock's:

- ``gpipe`` and ``ScheduleGPipe``, ``1f1b`` and ``Schedule1F1B`` (torch needs m >= p for 1F1B);
- ``interleaved-1f1b`` (two chunks per rank) and ``ScheduleInterleaved1F1B`` on the same two chunks;
- ``zb-h1`` and ``ScheduleInterleavedZeroBubble`` with *one* stage per rank: its order is then exactly
  ZB-H1's (F, I, W per rank, W deferred by the rank's index);
- ``zb-v`` and ``ScheduleZBVZeroBubble`` on the same two chunks per rank, placed in a V (its lists are
  pipeclock's, action for action; ``tests/test_v_schedules.py`` checks it).

The step counts are chosen so the full sweep ends in about ten minutes on two quiet cores; the cases the
issue sets targets on (two ranks, hidden 1024, m in {4, 8}) get more steps, since their medians are
judged. At hidden 2048 a step takes seconds, so there the sweep leaves out interleaved 1F1B (the schedule
whose comparison the smaller widths already show) and takes two timed steps per engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
}
BATCH = 256
LAYERS = 16


@dataclass(frozen=True)
class Case:
    """One configuration, timed for ``steps`` steps per engine after one checked warm-up step each."""

    stages: int
    hidden: int
    microbatches: int
    schedule: str
    steps: int
    batch: int = BATCH
    layers: int = LAYERS

    @property
    def chunks(self) -> int:
        return 2 if self.schedule in ("interleaved-1f1b", "zb-v") else 1

    @property
    def placement(self) -> str:
        return "v" if self.schedule == "zb-v" else "loop"

    @property
    def torch_schedule(self) -> str | None:
        """The torch class that runs the same order, or None where torch refuses the configuration."""
        if self.schedule == "1f1b" and self.microbatches < self.stages:
            return None
        return TORCH_SCHEDULES[self.schedule]

    @property
    def is_target(self) -> bool:
        """One of the configurations the issue sets its speed targets on."""
        return (self.stages, self.hidden, self.batch) == (2, 1024, 256) and self.microbatches in (4, 8)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """The cases, and the one-process baselines (hidden, m) the efficiencies need."""

    cases: tuple[Case, ...]
    baseline_steps: dict[int, int]  # hidden -> timed steps of the one-process baseline

    def for_stages(self, stages: int) -> list[Case]:
        return [case for case in self.cases if case.stages == stages]

    @property
    def stage_counts(self) -> list[int]:
        return sorted({case.stages for case in self.cases})

    def baselines(self) -> list[tuple[int, int]]:
        """Every (hidden, m) that some case needs T1 for."""
        return sorted({(case.hidden, case.microbatches) for case in self.cases})


def _steps(hidden: int, target: bool, scale: float) -> int:
    base = {512: 5, 1024: 3, 2048: 2}.get(hidden, 3)
    return max(1, round((10 if target else base) * scale))


def _schedules_for(hidden: int, schedules: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s for s in schedules if not (hidden >= 2048 and s == "interleaved-1f1b"))


def sweep(
    stages: tuple[int, ...] = (2, 4),
    hiddens: tuple[int, ...] = (512, 1024, 2048),
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16),
    schedules: tuple[str, ...] = SCHEDULES,
    scale: float = 1.0,
) -> Plan:
    """The cross product of the given values; ``scale`` multiplies every step count."""
    cases = []
    for p in stages:
        for hidden in hiddens:
            for m in microbatches:
                for name in _schedules_for(hidden, schedules):
                    probe = Case(p, hidden, m, name, steps=1)
                    cases.append(Case(p, hidden, m, name, _steps(hidden, probe.is_target, scale)))
    return Plan(tuple(cases), {h: _steps(h, False, scale) for h in hiddens})


def full() -> Plan:
    """The issue's sweep: p in {2, 4}, hidden in {512, 1024, 2048}, m in {1, 2, 4, 8, 16}, four schedules."""
    return sweep()


def quick() -> Plan:
    """A few minutes: two ranks, hidden 512 and 1024, m in {2, 4, 8}."""
    return sweep(stages=(2,), hiddens=(512, 1024), microbatches=(2, 4, 8), scale=0.5)


def targets() -> Plan:
    """The issue's target cases only: two ranks, hidden 1024, m in {4, 8}, all four schedules."""
    return sweep(stages=(2,), hiddens=(1024,), microbatches=(4, 8))


def small_actions() -> Plan:
    """The cases with the least compute per action, where an engine's own cost shows most: hidden 512
    with m in {1, 2}, and m = 1 at hidden 1024 and 2048, on two and four ranks."""
    cases = (
        sweep(hiddens=(512,), microbatches=(1, 2)).cases
        + sweep(hiddens=(1024, 2048), microbatches=(1,)).cases
    )
    return Plan(
        tuple(cases),
        {512: _steps(512, False, 1.0), 1024: _steps(1024, False, 1.0), 2048: _steps(2048, False, 1.0)},
    )


def least_compute() -> Plan:
    """Hidden 512 with m in {1, 2} on two and four ranks: the cases where pipeclock is to be at or
    below torch's step, with the least compute per action of all."""
    return sweep(hiddens=(512,), microbatches=(1, 2))


def with_steps(chosen: Plan, steps: int) -> Plan:
    """The same cases, each timed for ``steps`` steps per engine (more steps: tighter medians)."""
    cases = tuple(replace(case, steps=steps) for case in chosen.cases)
    return Plan(cases, {hidden: steps for hidden in chosen.baseline_steps})


def v_schedules() -> Plan:
    """ZB-V against ZB-H1 and 1F1B (and torch's ZB-V): two ranks, hidden 1024, m in {4, 8}."""
    return sweep(stages=(2,), hiddens=(1024,), microbatches=(4, 8), schedules=("1f1b", "zb-h1", "zb-v"))


def program() -> Plan:
    """The simulator against the run: 1F1B, ZB-H1 and ZB-V on two ranks and 1F1B on four, hidden 1024,
    m in {4, 8} (``benchmarks.program_prediction``)."""
    two = sweep(stages=(2,), hiddens=(1024,), microbatches=(4, 8), schedules=("1f1b", "zb-h1", "zb-v"))
    four = sweep(stages=(4,), hiddens=(1024,), microbatches=(4, 8), schedules=("1f1b",))
    return Plan(two.cases + four.cases, two.baseline_steps)


def tiny() -> Plan:
    """Seconds: the smoke test's plan (two ranks, hidden 64, m = 2, two schedules)."""
    return sweep(stages=(2,), hiddens=(64,), microbatches=(2,), schedules=("1f1b", "zb-h1"), scale=0.7)


def to_json(plan: Plan) -> dict:
    return {"cases": [case.to_dict() for case in plan.cases], "baseline_steps": plan.baseline_steps}


def from_json(data: dict) -> Plan:
    steps = {int(hidden): n for hidden, n in data["baseline_steps"].items()}
    return Plan(tuple(Case(**case) for case in data["cases"]), steps)


def nothing() -> Plan:
    """No cases: for a run that measures only the engine overhead."""
    return Plan((), {})
