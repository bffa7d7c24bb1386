"""The rooms hold: each package imports only the rooms its ``__init__`` docstring names, and no module
imports itself back through another.

A room's allowed imports are written once, in its ``__init__`` docstring ("May import: engine, models."),
and read from there. ``comms`` is the base every room may stand on (``comms`` and its ``comm_*`` helpers);
``faces`` are the public faces ``pipeclock.model`` and ``pipeclock.schedule``. Read from the source, not
from a running interpreter: every ``import`` and ``from ... import`` of every module in a room, at any
depth (a function's own import counts too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipeclock"
BASE = {
    "comms": ("comms", "comm_blame", "comm_channels", "comm_errors", "comm_messages", "comm_tensors"),
    "faces": ("model", "schedule"),
}
ROOMS = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def allowed_rooms(room: str) -> list[str]:
    """The names after "May import:" in the room's ``__init__`` docstring."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())) or ""
    found = re.search(r"May import:([^.]*)\.", docstring)
    assert found, f"pipeclock/{room}/__init__.py's docstring says what the room may import"
    return [name.strip() for name in found.group(1).replace("\n", " ").split(",")]


def room_of(module: str) -> str | None:
    """The room (or base) a ``pipeclock.`` module belongs to; None for one outside the package."""
    parts = module.split(".")
    if parts[0] != "pipeclock" or len(parts) == 1:
        return None
    for base, members in BASE.items():
        if parts[1] in members:
            return base
    return parts[1]


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_only_the_rooms_it_names(room):
    allowed = {room, *allowed_rooms(room)}
    assert allowed <= {*ROOMS, *BASE}, f"{room}'s docstring names a room that does not exist"
    crossing = {}
    for path in sorted((PACKAGE / room).rglob("*.py")):
        outside = sorted(m for m in imported_modules(path) if room_of(m) not in (None, *allowed))
        if outside:
            crossing[str(path.relative_to(PACKAGE))] = outside
    assert not crossing, f"{room}/ imports from rooms its docstring does not name: {crossing}"


def test_the_base_stands_on_nothing_above_it():
    for name in BASE["comms"]:
        rooms = {room_of(m) for m in imported_modules(PACKAGE / f"{name}.py")} - {None, "comms"}
        assert not rooms, f"{name}.py imports from {rooms}"


def test_no_room_reaches_back_up_to_a_room_that_imports_it():
    rooms_imported = {room: set(allowed_rooms(room)) & set(ROOMS) for room in ROOMS}

    def reaches(start: str, target: str, seen: frozenset = frozenset()) -> bool:
        return any(
            nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt}))
            for nxt in rooms_imported[start]
        )

    circles = [room for room in ROOMS if reaches(room, room)]
    assert not circles, f"rooms that import themselves through others: {circles}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_itself_back_through_another():
    """A circle between modules (even one dodged by an import inside a function) is a missing direction."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {
        name: {
            m for m in imported_modules(path) if m in modules and m != name and not name.startswith(m + ".")
        }
        for name, path in modules.items()
    }
    circles = set()
    for start in graph:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.add(" -> ".join((*trail, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*trail, nxt)))
    assert not circles, f"import circles: {sorted(circles)}"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from pipeclock.observe.simulate import simulate\n")
    assert "pipeclock.observe.simulate" in imported_modules(module)
