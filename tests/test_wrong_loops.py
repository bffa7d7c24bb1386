"""Every wrong loop of ``tests/wrong_loops/`` is refused by ``lab N --check``, its cause on the first line.

Each file is a lab's loop with one mistake, named by its file; the table gives the lab it is checked
against and the start of the verdict's first line (a regular expression). The first line is what a learner
reads: it names the cause (a wrong order, the memory a loop keeps, a message on the wrong tag, a send never
waited for, the rank whose own code failed), never a symptom that follows from it. A few quick files run in
the default suite; the whole set is `long` (each check launches 2 and then 4 processes).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeclock.course.check import Verdict, check

WRONG = Path(__file__).resolve().parent / "wrong_loops"

FIRST_LINES = {  # file: (lab, the start of the verdict's first line)
    "one_f_one_b_keeps_every_graph": (
        6,
        r"wrong memory: 1F1B, p = 2, m = 3, rank 0 kept the saved tensors of 3 micro-batches alive at once "
        r"\(measured\), where 1F1B holds at most 2 \(min\(m, p − r\)\): the order is right, the memory is not",
    ),
    "interleaved_never_waits_for_its_sends": (
        7,
        r"wrong, with 2 ranks and m = 1: rank \d posted the (activation|gradient) of micro-batch 0 to rank "
        r"\d with comms.isend_tensor and never waited for it: isend_tensor returns at once",
    ),
}
QUICK = ("one_f_one_b_keeps_every_graph",)  # the default suite's share: a few seconds each


def first_line(name: str) -> str:
    lab = FIRST_LINES[name][0]
    with pytest.raises(Verdict) as raised:
        check(lab, WRONG / f"{name}.py")
    return str(raised.value).splitlines()[0]


def test_the_set_holds_thirty_wrong_loops_each_with_its_first_line():
    files = {path.stem for path in WRONG.glob("*.py")}
    assert files == set(FIRST_LINES), files ^ set(FIRST_LINES)
    assert len(files) >= 30


@pytest.mark.slow
@pytest.mark.parametrize("name", QUICK)
def test_a_quick_wrong_loop_is_refused_with_its_cause_first(name):
    assert re.match(FIRST_LINES[name][1], first_line(name)), first_line(name)


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(set(FIRST_LINES) - set(QUICK)))
def test_each_wrong_loop_is_refused_with_its_cause_first(name):
    line = first_line(name)
    assert re.match(FIRST_LINES[name][1], line), line
