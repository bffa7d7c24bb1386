"""What runs on a GPU, checked on the CPU: every tensor on its rank's device, and actions timed with
events read once the step is over, never a wait per action.

Every tensor on its rank's device: generation, the course's checker and the planner's measured mode make
no tensor without saying where, wherever they know the device. Here every rank computes on the CPU,
where a tensor made without ``device=`` lands anyway; on a GPU it would sit on the CPU beside the rank's
CUDA tensors, and the first operation joining them fails. So the paths run under a ``TorchFunctionMode``
that sees every call of a torch factory (``torch.tensor``, ``zeros``, ``randn`` ...) and writes down,
with its file and line, each one made from those rooms' own code without a device (a factory given a
generator takes the generator's device: not written down).

Timing: a CUDA event is recorded on the stream and read later; ``EventClock`` takes any event with that
API. On the CPU a stand-in records the host's clock when recorded and writes down every record and every
read, so the events path runs on real gloo ranks, and the test sees when the clock read its events. Both
run in one launch of two ranks.
"""

from __future__ import annotations

import inspect
import itertools
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pipeclock import schedule
from pipeclock.engine.action_clock import EventClock, HostClock, clock_for
from pipeclock.models.mlp import ShardedMLP
from tests.distributed import run_ok

PACKAGE = Path(__file__).resolve().parents[1] / "pipeclock"
TORCH = str(Path(torch.__file__).parent)
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
    torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm,
}  # fmt: skip


class DevicelessFactories(TorchFunctionMode):
    """Writes down ``file:line torch.name`` for each factory call without a device made from ``places``."""

    def __init__(self, places: list[Path]) -> None:
        super().__init__()
        self.places = tuple(str(place) for place in places)
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        keeps_its_device = func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
        if func in FACTORIES and kwargs.get("device") is None and "generator" not in kwargs:
            caller = _caller()
            if caller and caller.filename.startswith(self.places) and not keeps_its_device:
                where = Path(caller.filename).relative_to(PACKAGE.parent)
                self.found.append(f"{where}:{caller.lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


def _caller() -> inspect.FrameInfo | None:
    """Who asked for the tensor: the nearest frame, past this audit's own two, outside torch."""
    for frame in inspect.stack(context=0)[2:]:
        if not frame.filename.startswith(TORCH):
            return frame
    return None


def test_the_audit_writes_down_a_tensor_made_without_a_device():
    with DevicelessFactories([Path(__file__)]) as audit:
        torch.zeros(3)
        torch.zeros(3, device="cpu")
        torch.randn(2, generator=torch.Generator())
    assert len(audit.found) == 1 and audit.found[0].endswith("torch.zeros"), audit.found


def _generate_audited(rank: int, world: int) -> list[str]:
    """Two prompts in two groups across the ranks, past the window (it slides): what the audit found."""
    from pipeclock.generation.pipeline import Settings, StageRunner
    from pipeclock.models.gpt import GPT, GPTConfig

    config = GPTConfig(dim=16, layers=2, heads=2, seq_len=16)
    pieces = GPT.for_rank(config, rank, world)[0]
    settings = Settings(tokens=20, seq_len=16, dim=16, temperature=0.5)
    with DevicelessFactories([PACKAGE / "generation"]) as audit:
        StageRunner(pieces, [list(b"def "), list(b"x")], [[0], [1]], settings).run()
    return audit.found


def _on_two_ranks(rank: int, world: int) -> dict:
    return {"generation audit": _generate_audited(rank, world), "events": _timed_with_events(rank, world)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """One launch of two ranks for both properties below."""
    return run_ok(_on_two_ranks, 2)


def test_generation_on_two_ranks_says_where_each_tensor_goes(two_ranks):
    found = sorted({line for rank in two_ranks for line in rank["generation audit"]})
    assert found == [], "tensors made without a device:\n" + "\n".join(found)


def test_the_checker_and_the_measured_planner_say_where_each_tensor_goes():
    from pipeclock.course.check_rank import Case, Reference
    from pipeclock.models.gpt import GPTConfig
    from pipeclock.plan.model_specs import gpt_spec, mlp_spec
    from pipeclock.plan.profile import profile

    config = GPTConfig(dim=16, layers=2, heads=2, seq_len=16)
    with DevicelessFactories([PACKAGE / "course", PACKAGE / "plan"]) as audit:
        Reference(Case(batch=4, m=2, hidden=8, layers=4), stages=2)
        for spec in (gpt_spec(config), mlp_spec(8, 3)):
            profile(spec, 2, repeats=1, warmup=0, device=torch.device("cpu"))
    found = sorted(set(audit.found))
    assert found == [], "tensors made without a device:\n" + "\n".join(found)


# --- actions timed with events ---------------------------------------------------------------------


class StandInEvent:
    """``torch.cuda.Event``'s API on the CPU: ``record`` notes the host's clock; every call is logged."""

    log: ClassVar[list[tuple[str, int]]] = []
    times: ClassVar[dict[int, float]] = {}
    made = itertools.count()

    def __init__(self) -> None:
        self.number = next(StandInEvent.made)

    def record(self) -> None:
        StandInEvent.times[self.number] = time.perf_counter()
        StandInEvent.log.append(("record", self.number))

    def synchronize(self) -> None:
        StandInEvent.log.append(("read", self.number))

    def elapsed_time(self, later: StandInEvent) -> float:
        StandInEvent.log.append(("read", later.number))
        return (StandInEvent.times[later.number] - StandInEvent.times[self.number]) * 1e3


def _timed_with_events(rank: int, world: int) -> dict:
    out = {}
    for name in ("1f1b", "zb-h1"):
        pipe = schedule.Pipeline(ShardedMLP(16, 8, rank, world), name, 4)
        pipe.new_clock = lambda: EventClock(StandInEvent)
        StandInEvent.log.clear()
        pipe.step(torch.randn(16, 16), torch.randn(16, 16))
        spans = pipe.last.spans
        log = list(StandInEvent.log)
        out[name] = ([str(a) for a in pipe.actions], spans, log, dict(StandInEvent.times))
    return out


def test_events_are_read_once_the_step_is_over_and_give_each_action_its_span(two_ranks):
    for rank, results in enumerate(two_ranks):
        for name, (actions, spans, log, times) in results["events"].items():
            records = [number for what, number in log if what == "record"]
            first_read = next(index for index, (what, _) in enumerate(log) if what == "read")
            assert all(what == "read" for what, _ in log[first_read:]), (name, "an event read mid-step")
            assert len(records) >= 1 + 2 * len(actions), "an origin, and a start and an end per action"
            assert [str(s.action) for s in spans] == actions, name
            assert all(s.rank == rank and 0 <= s.wait <= s.duration for s in spans), name
            assert all(a.end <= b.start for a, b in itertools.pairwise(spans)), name
            # the first action's start to the last one's end: those two events' distance on the stand-in's
            # clock, placed on the host's time line (before now)
            total = times[records[-1]] - times[records[1]]
            assert abs((spans[-1].end - spans[0].start) - total) < 1e-9, name
            assert spans[0].duration > 0 and spans[-1].end <= time.perf_counter()


def test_the_host_clock_times_a_cpu_and_events_time_a_gpu():
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    clock = HostClock()
    first, second = clock.mark(), clock.mark()
    assert clock.seconds([first, second]) == [first, second] and first <= second
