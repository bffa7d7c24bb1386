"""The layers hold: arrows point down (app -> observe, parallel, models -> engine -> comms).

Read from the source, not from a running interpreter: every ``import`` and ``from ... import`` of every
module in a layer, at any depth (a function's own import counts too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipeclock"
FORBIDDEN = {
    "engine": ("observe", "parallel", "app", "models"),
    "models": ("app",),
    "parallel": ("app",),
    "observe": ("app",),
}


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_from_the_layers_above_it(layer):
    crossing = {}
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        above = {
            module
            for module in imported_modules(path)
            for upper in FORBIDDEN[layer]
            if module == f"pipeclock.{upper}" or module.startswith(f"pipeclock.{upper}.")
        }
        if above:
            crossing[str(path.relative_to(PACKAGE))] = sorted(above)
    assert not crossing, f"{layer}/ imports from a layer above it: {crossing}"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from pipeclock.observe.simulate import simulate\n")
    assert "pipeclock.observe.simulate" in imported_modules(module)
