"""``pipeclock lab N --check FILE``: the course's loops pass with their order drawn, an untouched exercise
says what to write, and a wrong loop is named by its cause: the place it leaves the lab's schedule, in
the schedule's terms; the micro-batch a wrong message really is; the sender's order behind a receiver's
shape error; a missing ``requires_grad_()``; each rank's wait beside what the schedule runs there.
Whatever the learner's file does when imported is one line, and no check ever prints a traceback.

The solutions' and the exercises' checks are the commands the lab pages quote (``run_once`` shares the
runs with the docs test); the wrong loops live in ``tests/wrong_loops/`` and are checked in this process.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from pipeclock.course.check import EXERCISES, Verdict, check, launch
from pipeclock.course.learner_file import LoadError, probe
from pipeclock.course.order import Lab, divergence, held
from pipeclock.engine.generators import generate
from pipeclock.observe.diagrams import ascii_diagram
from pipeclock.observe.simulate import simulate
from tests.commands import run_once

ROOT = Path(__file__).resolve().parents[1]
WRONG = Path(__file__).resolve().parent / "wrong_loops"
LOOPS = {  # lab: (file, schedule, its name, chunks, the skeleton's words)
    4: ("naive", "naive", "naive", 1, "write the naive loop"),
    5: ("gpipe", "gpipe", "GPipe", 1, "write the GPipe loop"),
    6: ("one_f_one_b", "1f1b", "1F1B", 1, "write the 1F1B loop"),
    7: ("interleaved", "interleaved-1f1b", "interleaved 1F1B", 2, "write the interleaved 1F1B loop"),
}


def checked(command: str) -> str:
    """A check's whole answer; its exit code says whether the loop is right."""
    ran = run_once(command).ran
    return ran.stdout + ran.stderr


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def verdict_on(lab: int, wrong: str) -> tuple[str, float]:
    """The check's answer on a wrong loop, how long it took, and that it left no process behind (ones
    started earlier, such as multiprocessing's resource tracker, are not the check's)."""
    start, before = time.monotonic(), children()
    with pytest.raises(Verdict) as raised:
        check(lab, WRONG / f"{wrong}.py")
    assert not (children() - before)
    return str(raised.value), time.monotonic() - start


# --- the course's own loops -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("lab", LOOPS)
def test_each_solution_passes_runs_its_schedules_order_and_holds_what_it_allows(lab):
    name, schedule, title, chunks, _ = LOOPS[lab]
    command = f"python -m pipeclock lab {lab} --check labs/solutions/{name}.py"
    assert run_once(command).ran.returncode == 0, checked(command)
    out = checked(command)
    head = f"all good: {EXERCISES[lab].function} runs {title}'s order and gives the one-process model's"
    assert head in out and "(p = 2: m = 1, 3, 4; p = 4: m = 2, 5, 8)" in out, out
    p, m = map(int, re.search(r"your loop with p = (\d) and m = (\d), in the order it ran", out).groups())
    assert m in [case.m for case in EXERCISES[lab].cases(p)], "a step the check ran"
    rows = generate(schedule, p, m, chunks)
    assert ascii_diagram(simulate(rows)) in out, f"its order, drawn, is the schedule's (p = {p}, m = {m})"
    peaks = " ".join(str(held(row)) for row in rows)
    assert f"held at most: {peaks} (rank 0 first)" in out
    assert "Traceback" not in out and "measured bubble" not in out


@pytest.mark.slow
@pytest.mark.parametrize("lab", LOOPS)
def test_an_untouched_exercise_fails_saying_what_to_write_and_where(lab):
    name, *_, words = LOOPS[lab]
    command = f"python -m pipeclock lab {lab} --check labs/exercises/{name}.py"
    assert run_once(command).ran.returncode == 1
    line = f"raised NotImplementedError: {words} (line {skeleton_line(name)} of labs/exercises/{name}.py"
    assert re.search(rf"^wrong, with 2 ranks and m = 1: rank \d {re.escape(line)}", checked(command), re.M)


def skeleton_line(name: str) -> int:
    lines = (ROOT / "labs" / "exercises" / f"{name}.py").read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if "raise NotImplementedError" in text)


# --- right numbers, wrong schedule: the order is checked --------------------------------------------------


@pytest.mark.slow
def test_a_loop_of_another_schedule_is_refused_where_it_leaves_the_labs_schedule():
    answer, _ = verdict_on(6, "gpipe_as_1f1b")  # GPipe for 1F1B: rank 1 must start backwards at once
    assert answer.startswith(
        "wrong order: 1F1B, p = 2, m = 3, rank 1: after F0 the schedule runs B0 (warm-up p − r − 1 = 0); "
        "your loop ran F1\n  rank 0 held 3 micro-batches at once, where 1F1B holds at most 2 (min(m, p − r))"
    ), answer
    assert "your loop's order" in answer and "rank 1 |...F0 F1 F2 B0" in answer  # drawn beside 1F1B's
    answer, _ = verdict_on(5, "naive_as_gpipe")
    assert answer.startswith(
        "wrong order: GPipe, p = 2, m = 3, rank 0: after F0 the schedule runs F1 (fill: all m forwards "
        "first); your loop ran B0"
    ), answer
    answer, _ = verdict_on(4, "gpipe_as_naive")
    assert answer.startswith(
        "wrong order: naive, p = 2, m = 3, rank 0: after F0 the schedule runs B0 (stop and wait: each "
        "micro-batch's backward before the next forward); your loop ran F1\n"
        "  rank 0 held 3 micro-batches at once, where naive holds at most 1\n"
    ), answer


@pytest.mark.slow
def test_an_extra_warm_up_forward_with_non_blocking_sends_is_refused_at_that_forward():
    answer, _ = verdict_on(6, "one_f_one_b_warms_up_once_more")
    assert answer.startswith(
        "wrong order: 1F1B, p = 2, m = 3, rank 0: after F1 the schedule runs B0 (warm-up p − r − 1 = 1); "
        "your loop ran F2\n  rank 0 held 3 micro-batches at once, where 1F1B holds at most 2"
    ), answer


def test_the_first_divergence_is_the_earliest_place_then_the_lowest_rank_and_a_short_loop_counts():
    lab = Lab("1f1b", 2, 3)
    right = [list(row) for row in generate("1f1b", 2, 3)]
    assert divergence(lab, dict(enumerate(right)), complete=True) is None
    assert divergence(lab, {0: right[0][:2], 1: right[1][:1]}, complete=False) is None  # still running
    (where, text) = divergence(lab, {0: right[0][:-1], 1: right[1]}, complete=True)
    assert where == (len(right[0]) - 1, 0) and text.endswith("your loop's step ended there")
    swapped = {0: right[0], 1: [right[1][0], right[1][2], right[1][1], *right[1][3:]]}
    assert divergence(lab, swapped, complete=False)[0] == (1, 1)


# --- diagnostics that point at the cause -----------------------------------------------------------------


@pytest.mark.slow
def test_a_gradient_that_is_another_micro_batchs_is_named_so_with_the_order_behind_it():
    answer, _ = verdict_on(5, "gpipe_last_stage_swaps_two_backwards")
    assert answer.startswith(
        "wrong, with 2 ranks and m = 3: rank 1, micro-batch 0, backward: sent a gradient that is "
        "micro-batch 1's, where micro-batch 0's is due\n"
        "  it follows from the order: GPipe, p = 2, m = 3, rank 1: after F2 the schedule runs B0 (drain: "
        "the backwards in the forwards' order); your loop ran B1"
    ), answer


@pytest.mark.slow
def test_a_shape_error_at_the_receiver_is_blamed_on_the_senders_order():
    answer, _ = verdict_on(5, "gpipe_last_stage_reverses_its_backwards")  # rank 0's receive is right
    assert answer.startswith(
        "wrong, with 2 ranks and m = 3: rank 1, micro-batch 0, backward: sent a gradient that is "
        "micro-batch 2's (shape (3, 8)), where micro-batch 0's (shape (4, 8)) is due\n"
        "  it follows from the order: GPipe, p = 2, m = 3, rank 1: after F2 the schedule runs B0"
    ), answer
    assert "ShapeMismatchError" not in answer


@pytest.mark.slow
def test_a_gradient_of_none_hints_requires_grad():
    answer, _ = verdict_on(4, "naive_forgets_requires_grad")
    assert answer == (
        "wrong, with 2 ranks and m = 1: rank 1, micro-batch 0, backward: sent None, not a gradient: "
        "x.grad stays None unless the input was marked with x.requires_grad_() before the forward"
    )


@pytest.mark.slow
def test_a_gpipe_that_weights_the_loss_by_the_wrong_count_is_named_at_its_first_wrong_gradient():
    answer, _ = verdict_on(5, "gpipe_scales_the_loss_by_m")
    # m = 3 cuts 11 samples 4, 4, 3: micro-batch 0 weighs 4/11, not 1/3 (11/12 = 0.9167)
    assert answer.startswith(
        "wrong, with 2 ranks and m = 3: rank 1, micro-batch 0, backward: sent a wrong gradient"
    )
    assert "it is 0.9167 times the right one" in answer


@pytest.mark.slow
def test_deadlocks_name_who_never_sent_what_beside_what_the_schedule_runs_there():
    answer, seconds = verdict_on(6, "one_f_one_b_forgets_a_send")
    assert answer.startswith("deadlock, with 4 ranks and m = 2: no rank has moved for"), answer
    never_sent = "rank 1 waits for the gradient of micro-batch 1 from rank 2, which finished its step without"
    assert f"{never_sent} sending it" in answer.splitlines()[0]
    assert (
        "rank 0: last did: sent the activation of micro-batch 1 to rank 1; waits for the gradient of "
        "micro-batch 0 from rank 1; 1F1B's next: B0" in answer
    )
    assert seconds < 90
    answer, seconds = verdict_on(6, "one_f_one_b_deadlocks_when_m_lt_p")  # a cool-down of p - r - 1 > m
    assert answer.startswith(
        "wrong order: 1F1B, p = 4, m = 2, rank 0: after B1 the schedule's step is over; your loop waits for "
        "one gradient more than the step has from rank 1\n  and then a deadlock, with 4 ranks and m = 2:"
    ), answer
    assert (
        "rank 0: last did: received the gradient of micro-batch 1 from rank 1; "
        "waits for one gradient more than the step has from rank 1; 1F1B: rank 0's step is over" in answer
    )
    assert seconds < 90


@pytest.mark.slow
def test_a_rank_that_fails_while_the_others_wait_is_one_verdict_and_never_a_traceback(capfd):
    """The case that raced: rank 0 raises (its warm-up asks for micro-batch 2 of 2) while ranks 1-3 wait
    for it, and lose their peer. Repeated, since what the others print depended on who noticed first."""
    exercise = EXERCISES[6]
    for _ in range(5):
        with pytest.raises(Verdict) as raised:
            launch(exercise, WRONG / "one_f_one_b_warms_up_past_m.py", 4)
        assert str(raised.value).startswith(
            "wrong, with 4 ranks and m = 2: rank 0 raised IndexError: list index out of range (line 23 of"
        ), raised.value
        printed = capfd.readouterr()
        assert printed.out == "" and printed.err == "", printed


# --- what the learner's file does when imported -----------------------------------------------------------

AT_IMPORT = {  # the file's text: what the check says of it
    "while True:\n    pass\n": "was still being imported after 1s (an endless loop at module level?)",
    "import sys\n\ndef naive_step(*args):\n    pass\n\nsys.exit(0)\n": (
        "calls sys.exit(0) when imported (line 6: `sys.exit(0)`)"
    ),
    "import os\n\nos._exit(3)\n": "ended the process with exit code 3 while being imported (an os._exit?)",
    "from pipeclock import comms\n\n\ndef naive_step(stage, inputs, targets, m):\n"
    "    return comms.recv_tensor(None, comms.get_prev_rank())\n\n\nnaive_step(None, None, None, 2)\n": (
        "calls comms.get_prev_rank() when imported (line 8: `naive_step(None, None, None, 2)`)"
    ),
    "def naive_step(stage, inputs, targets, m):\n    return 1 / 0\n\n\nnaive_step(None, None, None, 2)\n": (
        "raised ZeroDivisionError: division by zero when imported (line 5: `naive_step(None, None, None, 2)`)"
    ),
    "def naive_step(:\n": "cannot be loaded: SyntaxError: invalid syntax (line 1)",
    "def gpipe_step():\n    pass\n": "defines no function naive_step(...)",
}


def test_whatever_a_file_does_when_imported_is_one_line_and_the_checker_goes_on(tmp_path, capfd):
    for number, (text, said) in enumerate(AT_IMPORT.items()):
        learner = tmp_path / f"mine{number}.py"
        learner.write_text(text)
        with pytest.raises(LoadError) as raised:
            probe(learner, "naive_step", limit=1.0)
        assert said in str(raised.value) and "\n" not in str(raised.value), raised.value
        if "defines no function" not in said and "SyntaxError" not in said:
            assert 'put it under `if __name__ == "__main__":`' in str(raised.value)
    assert "Traceback" not in capfd.readouterr().err


def test_a_file_that_exits_at_import_fails_the_check_with_exit_code_1(tmp_path):
    learner = tmp_path / "mine.py"
    learner.write_text("import sys\n\nsys.exit(0)\n")
    done = run_once(f"python -m pipeclock lab 4 --check {learner}").ran
    assert done.returncode == 1 and "calls sys.exit(0) when imported" in done.stdout, (
        done.stdout + done.stderr
    )
    assert "Traceback" not in done.stderr


def test_a_lab_without_a_loop_is_one_line_before_any_process_starts(tmp_path):
    empty = tmp_path / "mine.py"
    empty.write_text("def gpipe(): pass\n")
    with pytest.raises(Verdict, match=r"mine.py defines no function gpipe_step\(\.\.\.\)"):
        check(5, empty)
    with pytest.raises(Verdict, match="lab 3 has no loop to check; the labs that do: 4, 5, 6, 7"):
        check(3, empty)


def test_each_lab_page_hands_out_the_skeleton_and_keeps_the_answer_after_the_exercise():
    for page in ("lab4-naive", "lab5-gpipe", "lab6-1f1b", "lab7-interleaved"):
        text = (ROOT / "docs" / f"{page}.md").read_text()
        exercise = text.index("## Write it yourself")
        skeleton = re.search(r"<!-- skeleton: (\S+) -->\n```python\n(.*?)\n```", text, re.S)
        assert skeleton and skeleton.start() > exercise, f"{page} hands out no skeleton in its exercise"
        code = (ROOT / skeleton[1]).read_text()
        assert skeleton[2] == code[code.index("def ") :].rstrip("\n"), f"{page}: {skeleton[1]} changed"
        answer = re.search(r"<!-- loop: (\S+) -->\n```python\n(.*?)\n```", text, re.S)
        assert answer, f"{page} quotes no loop"
        assert answer.start() > text.index("## The answer") > exercise, (
            f"{page}: the answer before the exercise"
        )
        assert "[The answer](#the-answer)" in text[exercise : answer.start()], (
            f"{page} does not say where it is"
        )
        code = (ROOT / answer[1]).read_text()
        assert answer[2] == code[code.index("import torch") :].rstrip("\n"), f"{page}: {answer[1]} changed"
