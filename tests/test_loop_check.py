"""``pipeclock lab N --check FILE``: the course's loops pass, an untouched exercise says what to write, and a
wrong loop is named by rank, micro-batch and fault, within seconds, leaving no process behind.

The solutions' and the exercises' checks are the commands the lab pages quote (``run_once`` shares the runs
with the docs test); the wrong loops live in ``tests/wrong_loops/`` and are checked in this process.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from pipeclock.course.check import Verdict, check
from pipeclock.engine.generators import bubble_formula
from tests.commands import run_once

ROOT = Path(__file__).resolve().parents[1]
WRONG = Path(__file__).resolve().parent / "wrong_loops"
LOOPS = {  # lab: (file, schedule, chunks, the skeleton's words)
    4: ("naive", "naive", 1, "write the naive loop"),
    5: ("gpipe", "gpipe", 1, "write the GPipe loop"),
    6: ("one_f_one_b", "1f1b", 1, "write the 1F1B loop"),
    7: ("interleaved", "interleaved-1f1b", 2, "write the interleaved 1F1B loop"),
}


def checked(command: str) -> str:
    """A check's whole answer; its exit code says whether the loop is right."""
    ran = run_once(command).ran
    return ran.stdout + ran.stderr


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def no_process_left(before: set[int]) -> bool:
    """No process the check started outlives it (ones started earlier, such as multiprocessing's
    resource tracker from another test, are not the check's)."""
    return not (children() - before)


@pytest.mark.slow
@pytest.mark.parametrize("lab", LOOPS)
def test_each_solution_passes_with_its_measured_bubble_beside_the_formula(lab):
    name, schedule, chunks, _ = LOOPS[lab]
    command = f"python -m pipeclock lab {lab} --check labs/solutions/{name}.py"
    assert run_once(command).ran.returncode == 0, checked(command)
    out = checked(command)
    assert "all good" in out and "(p = 2: m = 1, 3, 4; p = 4: m = 2, 5, 8)" in out, out
    bubbles = re.findall(r"p = (\d), m = (\d+): measured bubble ([\d.]+)% vs formula .* = ([\d.]+)%", out)
    assert [(p, m) for p, m, *_ in bubbles] == [("2", "4"), ("4", "8")], out
    for p, m, measured, formula in bubbles:
        assert float(formula) == round(100 * bubble_formula(schedule, int(p), int(m), chunks), 1)
        assert 0 < float(measured) < 100


@pytest.mark.slow
@pytest.mark.parametrize("lab", LOOPS)
def test_an_untouched_exercise_fails_saying_what_to_write_and_where(lab):
    name, _, _, words = LOOPS[lab]
    command = f"python -m pipeclock lab {lab} --check labs/exercises/{name}.py"
    assert run_once(command).ran.returncode == 1
    line = f"raised NotImplementedError: {words} (line {skeleton_line(name)} of labs/exercises/{name}.py"
    assert re.search(rf"^wrong, with 2 ranks and m = 1: rank \d {re.escape(line)}", checked(command), re.M)


def skeleton_line(name: str) -> int:
    lines = (ROOT / "labs" / "exercises" / f"{name}.py").read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if "raise NotImplementedError" in text)


def verdict_on(lab: int, wrong: str) -> tuple[str, float]:
    start, before = time.monotonic(), children()
    with pytest.raises(Verdict) as raised:
        check(lab, WRONG / f"{wrong}.py")
    assert no_process_left(before)
    return str(raised.value), time.monotonic() - start


@pytest.mark.slow
def test_a_1f1b_that_forgets_a_backward_send_is_a_deadlock_naming_who_never_sent_what():
    answer, seconds = verdict_on(6, "one_f_one_b_forgets_a_send")
    assert answer.startswith("deadlock, with 4 ranks and m = 2: no rank has moved for"), answer
    never_sent = "rank 1 waits for the gradient of micro-batch 1 from rank 2, which finished its step without"
    assert f"{never_sent} sending it" in answer
    assert (
        "rank 0: last did: sent the activation of micro-batch 1 to rank 1; waits for the gradient" in answer
    )
    assert seconds < 90


@pytest.mark.slow
def test_a_gpipe_that_weights_the_loss_by_the_wrong_count_is_named_at_its_first_wrong_gradient():
    answer, _ = verdict_on(5, "gpipe_scales_the_loss_by_m")
    # m = 3 cuts 11 samples 4, 4, 3: micro-batch 0 weighs 4/11, not 1/3 (11/12 = 0.9167)
    assert answer.startswith(
        "wrong, with 2 ranks and m = 3: rank 1, micro-batch 0, backward: sent a wrong gradient"
    )
    assert "it is 0.9167 times the right one" in answer


@pytest.mark.slow
def test_a_1f1b_whose_cool_down_ignores_m_less_than_p_deadlocks_waiting_for_a_gradient_that_does_not_exist():
    answer, seconds = verdict_on(6, "one_f_one_b_deadlocks_when_m_lt_p")
    assert answer.startswith("deadlock, with 4 ranks and m = 2:"), answer
    assert (
        "rank 0: last did: received the gradient of micro-batch 1 from rank 1; "
        "waits for one gradient more than the step has from rank 1" in answer
    )
    assert seconds < 90


def test_a_file_without_the_function_is_one_line_before_any_process_starts(tmp_path):
    empty = tmp_path / "mine.py"
    empty.write_text("def gpipe(): pass\n")
    with pytest.raises(Verdict, match=r"mine.py defines no function gpipe_step\(\.\.\.\)"):
        check(5, empty)
    with pytest.raises(Verdict, match="lab 3 has no loop to check; the labs that do: 4, 5, 6, 7"):
        check(3, empty)


def test_each_lab_page_quotes_its_loop_as_the_file_has_it():
    for page in ("lab4-naive", "lab5-gpipe", "lab6-1f1b", "lab7-interleaved"):
        text = (ROOT / "docs" / f"{page}.md").read_text()
        source = re.search(r"<!-- loop: (\S+) -->\n```python\n(.*?)\n```", text, re.S)
        assert source, f"{page} quotes no loop"
        code = (ROOT / source[1]).read_text()
        assert source[2] == code[code.index("import torch") :].rstrip("\n"), f"{page}: {source[1]} changed"
