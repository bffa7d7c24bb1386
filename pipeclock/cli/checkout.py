"""The source checkout around the package: the labs, the benchmarks and the course's tooling live there.

They are not part of the library. Run from a clone (``pip install -e .``, ``make``), pipeclock finds them
beside the package; installed with ``pip install .``, it has only the library, and a command that needs
the checkout says so in one line instead of failing on a missing file.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def checkout_folder(name: str, command: str) -> Path:
    """The checkout's folder ``name`` (``labs``, ``benchmarks``, ``tools``); a one-line exit without one."""
    folder = ROOT / name
    if (ROOT / "pyproject.toml").is_file() and folder.is_dir():
        return folder
    raise SystemExit(
        f"pipeclock {command}: needs a source checkout of pipeclock ({name}/ is not installed with the "
        f"package): clone the repository, pip install -e . there, and run it from the clone"
    )


def import_from_checkout(module: str, command: str) -> ModuleType:
    """Import ``module`` (e.g. ``benchmarks.run``) from the checkout, or exit as `checkout_folder` does."""
    checkout_folder(module.split(".")[0], command)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(module)
