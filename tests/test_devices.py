"""Every tensor on its rank's device: generation, the course's checker and the planner's measured mode make
no tensor without saying where, wherever they know the device.

Here every rank computes on the CPU, where a tensor made without ``device=`` lands anyway; on a GPU it
would sit on the CPU beside the rank's CUDA tensors, and the first operation joining them fails. So the
paths run here under a ``TorchFunctionMode`` that sees every call of a torch factory (``torch.tensor``,
``zeros``, ``randn`` ...) and writes down, with its file and line, each one made from those rooms' own
code without a device (a factory given a generator takes the generator's device: not written down).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

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


def test_generation_on_two_ranks_says_where_each_tensor_goes():
    found = sorted({line for rank in run_ok(_generate_audited, 2) for line in rank})
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
