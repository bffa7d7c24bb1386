"""CI's log ends with what failed: pytest runs last, with its one-line-per-failure summary at the end."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_OPTIONS = {"-q", "-ra", "--tb=short"}


def pytest_words(line: str) -> list[str]:
    words = shlex.split(line.replace("$(BIN)", ".venv/bin"))
    return words[words.index("pytest") - 2 :]  # PYTHON -m pytest ...


def without_marker_filter(words: list[str]) -> list[str]:
    """``words`` (``PYTHON -m pytest ...``) less pytest's ``-m EXPRESSION``: every test, ``long`` included."""
    options = words[3:]
    if "-m" not in options:
        return words
    at = 3 + options.index("-m")
    return words[:at] + words[at + 2 :]


def test_ci_runs_pytest_last_and_as_make_test_does_with_the_long_tests_too():
    script = [
        line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")
    ]
    assert script[-1].startswith("exec ") and "pytest" in script[-1], "pytest is the last process, not make"
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test:.*\n\t(.*)\n", makefile, re.MULTILINE).group(1)
    assert '-m "not long"' in recipe, "make test leaves the long tests to make test-slow"
    assert pytest_words(script[-1]) == without_marker_filter(pytest_words(recipe))
    assert set(pytest_words(recipe)) >= SUMMARY_OPTIONS


def test_with_those_options_the_failures_summary_ends_the_output(tmp_path):
    (tmp_path / "test_example.py").write_text(
        "def test_passes():\n    assert True\n\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n\n"
        "def test_fails_too():\n    raise RuntimeError('boom')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *sorted(SUMMARY_OPTIONS), "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stdout.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if "short test summary info" in line)
    tail = lines[header + 1 :]
    # one line per failure; on CI (the CI variable set) pytest adds the rest of a multi-line message
    assert [line.split(" - ")[0] for line in tail[:-1] if line.startswith("FAILED ")] == [
        "FAILED test_example.py::test_fails",
        "FAILED test_example.py::test_fails_too",
    ]
    assert "arithmetic" in tail[0] and "boom" in "\n".join(tail[1:-1])
    assert re.fullmatch(r"2 failed, 1 passed in [\d.]+s", tail[-1]), tail[-1]
