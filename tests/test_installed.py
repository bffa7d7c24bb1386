"""An installed pipeclock works outside its checkout: ``pip install .`` (not editable) into a fresh venv.

The library's commands run (``train`` on one process, ``schedule``, ``plan``, ``explore``); those that need
the source checkout (``lab``, ``bench``, ``docs``) say so in one line. The venv borrows the project's
installed dependencies through a ``.pth`` line instead of installing torch again, so the test takes seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDS_CHECKOUT = "needs a source checkout of pipeclock"
PLAN_CHOICES = ("--device-memory", "12GB", "--schedules", "1f1b", "--stages", "1,2", "--microbatches", "4")


def _dependencies() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a fresh venv with pipeclock installed from a copy of the package's sources."""
    where = tmp_path_factory.mktemp("installed")
    source = where / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "pipeclock", source / "pipeclock", ignore=shutil.ignore_patterns("__pycache__"))
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "borrowed_dependencies.pth").write_text(f"{_dependencies()}\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps"]
    install += ["--no-build-isolation", "--no-index", str(source)]
    subprocess.run(install, check=True, timeout=300, env=_environment())
    return python


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def pipeclock(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "pipeclock", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=_environment(),
    )


def test_the_installed_package_is_the_one_that_runs_and_carries_the_explorer_page(installed, tmp_path):
    found = subprocess.run(
        [installed, "-c", "import pipeclock.observe.explorer as e; print(e.__file__); print(e.PAGE_FILES)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=_environment(),
    )  # fmt: skip
    module, page_files = found.stdout.split()
    assert not Path(module).is_relative_to(ROOT), module
    assert sorted(p.name for p in Path(page_files).iterdir()) == ["explorer.css", "explorer.js", "page.html"]


def test_the_library_commands_run_outside_the_checkout(installed, tmp_path):
    schedule = pipeclock(installed, "schedule", "1f1b", "-p", "2", "-m", "4", cwd=tmp_path)
    assert schedule.returncode == 0 and "makespan" in schedule.stdout, schedule.stderr
    plan = pipeclock(installed, "plan", "--params", "1e9", *PLAN_CHOICES, cwd=tmp_path)
    assert plan.returncode == 0 and "answer: 2 stages" in plan.stdout, plan.stdout + plan.stderr
    explore = pipeclock(installed, "explore", "--out", "explorer.html", cwd=tmp_path)
    assert explore.returncode == 0 and 'id="explorer-data"' in (tmp_path / "explorer.html").read_text()
    train = pipeclock(installed, "train", "--steps", "2", "--hidden", "16", "--layers", "2", cwd=tmp_path)
    assert train.returncode == 0, train.stderr
    assert train.stdout.splitlines()[-1].startswith("final loss "), train.stdout


def test_the_commands_that_need_the_checkout_say_so_in_one_line(installed, tmp_path):
    for command in (["lab", "4"], ["bench", "--quick"], ["docs", "--quick"]):
        ran = pipeclock(installed, *command, cwd=tmp_path)
        assert ran.returncode != 0 and ran.stdout == "", (command, ran.stdout)
        assert ran.stderr.count("\n") == 1 and NEEDS_CHECKOUT in ran.stderr, (command, ran.stderr)
        assert ran.stderr.startswith(f"pipeclock {command[0]}: "), ran.stderr
