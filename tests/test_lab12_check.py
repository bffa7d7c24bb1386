"""``pipeclock lab 12 --check FILE``: the hand-written column- and row-parallel Linears are held to one
process on real gloo processes; the solution passes, and each wrong split is one line that names the rank
and what is missing, within seconds, leaving no process behind.

The wrong files live in ``tests/wrong_tensor_parallel/``, each the solution with one mistake, and are checked
in this process (each check forks its ranks: no interpreter starts); the page's two commands (the untouched
exercise, the solution) are the runs the docs test makes too (``run_once``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from pipeclock.course.tp_check import Verdict, check
from tests.commands import run_once

ROOT = Path(__file__).resolve().parents[1]
WRONG = Path(__file__).resolve().parent / "wrong_tensor_parallel"
STALL = 3.0  # seconds: the stuck case's wait (the check's own default is longer, for loaded machines)

# file: the start of its one-line answer (a regular expression)
ANSWERS = {
    "column_slices_the_wrong_dim": (
        r"wrong, with 2 ranks: rank 0: ColumnParallelLinear\.weight has shape \(64, 8\), this rank's share "
        r"of the \(64, 16\) weight is \(32, 16\) \(yours cuts the other dim\): a column split keeps rows"
    ),
    "row_forgets_the_all_reduce": (
        r"wrong, with 2 ranks: rank 0: RowParallelLinear's output is this rank's partial product alone: its "
        r"forward must sum the ranks' partial products \(all_reduce in SumOverRanks's forward\)"
    ),
    "column_forgets_the_backward_all_reduce": (
        r"wrong, with 2 ranks: rank 0: the gradient of ColumnParallelLinear's input is this rank's part "
        r"alone \(through its own features\): the column split's backward must sum it over the ranks"
    ),
    "row_sums_the_gradient_twice": (
        r"wrong, with 2 ranks: rank 0: the gradient of RowParallelLinear's input is 2 times one process's: "
        r"the row split's sum also summed the gradient on its way back"
    ),
    "row_adds_the_bias_on_every_rank": (
        r"wrong, with 2 ranks: rank 0: RowParallelLinear's output holds the bias 2 times: every rank adds it "
        r"before the sum"
    ),
    # rank 0 waits in a sum rank 1 never calls; rank 1's output is then its partial product
    "sums_on_rank_0_only": (
        r"wrong, with 2 ranks: rank 1: RowParallelLinear's output is this rank's partial product"
    ),
    # right numbers, wrong code: the page's words
    "column_sums_the_handed_gradient_in_place": (
        r"wrong, with 2 ranks: rank 0: SumGradientsOverRanks's backward all-reduces the gradient it was "
        r"handed in place \(line \d+ of \S+: `dist.all_reduce\(grad\)`\): the sum works in place: all-reduce "
        r"a copy \(grad.clone\(\)\); the gradient handed to a backward may be used elsewhere in the graph"
    ),
    "row_sums_its_input_in_place": (
        r"wrong, with 2 ranks: rank 0: SumOverRanks's forward all-reduces its own input in place .*: the "
        r"sum works in place: all-reduce a copy \(x.clone\(\)\); a Function that changes its input in place "
        r"must tell autograd so \(ctx.mark_dirty\)"
    ),
    "row_all_reduces_bare_in_its_forward": (
        r"wrong, with 2 ranks: rank 0: a bare dist.all_reduce in a forward \(line \d+ .*\): autograd passes "
        r"the gradient through an operation it does not know; torch warns that this \"may lead to silently "
        r"incorrect behavior\""
    ),
    "column_sums_its_output_forward": (
        r"wrong, with 2 ranks: rank 0: ColumnParallelLinear's forward calls all_reduce \(line \d+ .*\): a "
        r"column split's forward needs no sum"
    ),
    "column_splits_unevenly": (
        r"wrong, with 2 ranks: rank 0: ColumnParallelLinear\.weight has shape \(33, 16\), this rank's share "
        r"of the \(64, 16\) weight is \(32, 16\): the right dim, an uneven share: rank 0 keeps 33 rows where "
        r"each rank keeps 32"
    ),
    "column_waits_for_a_message_nobody_sends": (
        r"stuck, with 2 ranks: no rank moved for 3s \(rank 0 is still in ColumnParallelLinear's forward; "
        r"rank 1 is still in ColumnParallelLinear's forward\): a collective or a message that not every rank"
    ),
}


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def answer_for(learner: Path) -> str:
    """The check's one line for ``learner``, after asserting that no process it started is left."""
    before = children()
    try:
        answer = check(learner, stall=STALL)
    except Verdict as verdict:
        answer = str(verdict)
    assert not (children() - before), "the check left a process behind"
    return answer


def test_the_solution_passes_and_each_wrong_split_is_one_line_naming_the_rank_and_what_is_missing():
    assert {path.stem for path in WRONG.glob("*.py")} == set(ANSWERS), "every wrong file has its answer"
    started = time.monotonic()
    right = answer_for(ROOT / "labs" / "solutions" / "tensor_parallel.py")
    assert right.startswith("all good: ColumnParallelLinear and RowParallelLinear give one process's"), right
    assert right.endswith("on 2 and 4 ranks")
    for name, expected in ANSWERS.items():
        answer = answer_for(WRONG / f"{name}.py")
        assert "\n" not in answer and "Traceback" not in answer, answer
        assert re.match(expected, answer), f"{name}: {answer}"
    assert time.monotonic() - started < 120


def test_a_file_without_the_classes_or_failing_at_import_is_one_line_before_any_process_starts(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\n\nclass ColumnParallelLinear(torch.nn.Module)\n    pass\n")
    with pytest.raises(
        Verdict, match=r"^\S*broken.py cannot be loaded: SyntaxError: expected ':' \(broken.py, line 4\)$"
    ):
        check(broken)
    partial = tmp_path / "mine.py"
    partial.write_text("class ColumnParallelLinear:\n    pass\n")
    with pytest.raises(
        Verdict,
        match=r"^\S*mine.py cannot be loaded: LookupError: \S*mine.py defines no class RowParallelLinear$",
    ):
        check(partial)
    failing = tmp_path / "exits.py"
    failing.write_text("import sys\nsys.exit('not yet')\n")
    with pytest.raises(Verdict, match=r"^\S*exits.py cannot be loaded: SystemExit: not yet$"):
        check(failing)
    with pytest.raises(Verdict, match=r"^no file \S*absent.py$"):
        check(tmp_path / "absent.py")


def test_the_untouched_exercise_says_what_to_write_and_where():
    ran = run_once("python -m pipeclock lab 12 --check labs/exercises/tensor_parallel.py").ran
    assert ran.returncode == 1 and "Traceback" not in ran.stdout + ran.stderr
    lines = (ROOT / "labs" / "exercises" / "tensor_parallel.py").read_text().splitlines()
    first = next(n for n, text in enumerate(lines, 1) if "keep this rank's rows" in text)
    assert re.search(
        rf"^wrong, with 2 ranks: rank 0 raised NotImplementedError: keep this rank's rows of the weight and "
        rf"of the bias \(line {first} of labs/exercises/tensor_parallel.py: ",
        ran.stdout,
        re.M,
    ), ran.stdout


def test_the_command_refuses_a_missing_file_and_names_lab_12_among_the_checked_labs(tmp_path, capsys):
    from pipeclock.cli.commands.lab import check as command

    assert command(12, tmp_path / "none.py") == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err == f"pipeclock lab: error: --check {tmp_path}/none.py: no such file\n"
    assert command(3, tmp_path / "none.py") == 2
    assert "the labs that do: 4, 5, 6, 7, 12" in capsys.readouterr().err
