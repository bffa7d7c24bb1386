"""The course pages say what the code does today: every quoted command prints what its page shows.

How a page quotes a command (the full text is in ``tools/docs_build.py`` and docs/index.md):

- a ```console block holds one command, on its first line after ``$ ``, run from the repository root in
  the virtual environment; the other lines are its standard output;
- the quote is the whole output, except where a line ``...`` marks lines left out;
- lines match word for word, numbers included, unless a ``<!-- docs ... -->`` comment right above the
  block says ``vary: REGEX`` (measured numbers may differ in those lines: decimals, thousands, percents,
  not the value after ``= ``), ``any: REGEX`` (any line where REGEX finds the same text), or
  ``long: REASON``: then this test skips the command with that reason, unless PIPECLOCK_DOCS_LONG=1.
  ``make docs`` runs the long ones too, and fails if their quotes no longer match.

A ``schedule``, ``plan`` or loop lab's ``--check`` command starts no interpreter: it runs in the test's
own process (``docs_run.run_here``), as ``make docs`` runs it; a lab runs on forked ranks
(``tests.commands``). Tests below run one of each as typed and check that it prints the same.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.commands import run_lab_forked, run_once
from tools.docs_build import (
    Mismatch,
    Notes,
    PageError,
    bounds_problems,
    check,
    matched_lines,
    pages,
    prose_problems,
    read_blocks,
)
from tools.docs_run import run_command, run_here, runs_here
from tools.docs_tables import refresh_generated

RUN_LONG = os.environ.get("PIPECLOCK_DOCS_LONG") == "1"
BLOCKS = [block for page in pages() for block in read_blocks(page)]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)#]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_a_quoted_command_prints_what_its_page_shows(block):
    if block.notes.long and not RUN_LONG:
        pytest.skip(f"long: {block.notes.long} (PIPECLOCK_DOCS_LONG=1 runs it)")
    assert block.output, f"{block}: quotes no output yet; `make docs` writes it in"
    ran = run_once(block.command).ran
    try:
        printed = check(block, ran)
    except Mismatch as mismatch:
        pytest.fail(f"{block}\n{mismatch}\n--- printed:\n{ran.stdout}{ran.stderr}")
    assert bounds_problems(block, printed) == [], "a measured value left the bounds its page states"


@pytest.mark.parametrize("page", pages(), ids=lambda page: page.name)
def test_every_number_the_prose_cites_is_the_one_its_quote_prints(page):
    filled, problems = prose_problems(page)
    assert problems == [] and filled == page.read_text()


PROSE_NUMBER = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)? ms\b")
RANGE = re.compile(r"\d[\d.,]*\s*(?:–|to)\s*\d[\d.,]* ms\b")  # bounds, which vary no more than they say
CITATION = re.compile(r"<!--[=~][\w-]+-->[\d.,]+(?:\s*(?:–|-|to)\s*[\d.,]+)?")


@pytest.mark.parametrize(
    "page", [page for page in pages() if page.name.startswith("lab")], ids=lambda p: p.name
)
def test_a_lab_pages_prose_states_a_timing_as_bounds_or_as_its_runs_value(page):
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    exact = PROSE_NUMBER.findall(RANGE.sub("", CITATION.sub("", prose)))
    assert exact == [], "cite a timing (<!--=NAME-->), or give bounds (A to B ms, checked: <!--~NAME-->)"


@pytest.mark.parametrize(
    "command",
    [
        "python -m pipeclock schedule 1f1b --stages 2 --microbatches 4 --program",
        "python -m pipeclock plan --params 20e9 --layers 64 --stages 16 --schedules 1f1b --microbatches 8",
        "python -m pipeclock lab 5 --check labs/solutions/gpipe.py",
        "python -m pipeclock lab 4 --check tests/naive_that_prints.py",
    ],
)
def test_a_command_run_in_this_process_prints_what_it_prints_as_typed(command):
    assert runs_here(command)
    here, typed = run_here(command), run_command(command)
    assert (here.returncode, here.stdout, here.stderr) == (typed.returncode, typed.stdout, typed.stderr)


def test_a_lab_the_suite_runs_on_forked_ranks_prints_what_its_page_shows_as_typed_too():
    (block,) = [block for block in BLOCKS if block.command == "python -m pipeclock lab 3"]
    assert run_lab_forked(block.command) is not None, "the per-block test forks its ranks"
    check(block, run_command(block.command))  # pipeclock lab, then torchrun, then the lab's processes


def test_every_page_quotes_commands_and_the_long_ones_say_why():
    course = {page.name for page in pages()} - {"benchmarks.md", "index.md", "glossary.md", "faults.md"}
    quoting = {block.page.name for block in BLOCKS}
    assert course <= quoting, f"pages without a quoted command: {sorted(course - quoting)}"
    assert all(block.notes.long.strip() for block in BLOCKS if block.notes.long is not None)


def test_generated_tables_are_what_the_simulator_gives_today():
    for page in pages():
        text = page.read_text()
        assert refresh_generated(text) == text, f"{page.name}: run `python -m pipeclock docs --quick`"


def test_every_picture_and_link_on_the_pages_exists():
    for page in pages():
        text = page.read_text()
        for target in IMAGE.findall(text) + LINK.findall(text):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} points to {target}, which is missing"


def test_every_figure_a_page_shows_is_drawn_by_a_quoted_command():
    drawn = {name for block in BLOCKS for _, name in block.notes.figures}
    shown = {Path(target).name for page in pages() for target in IMAGE.findall(page.read_text())}
    # drawn by the benchmarks, and by tools/explorer_figure.py (a browser, not a quoted command)
    others = {name for name in shown if name.startswith("bench_") or name == "explorer.png"}
    assert shown - others <= drawn, f"figures no command draws: {sorted(shown - others - drawn)}"


def quick_build(docs: Path, *pages: str) -> tuple[int, str]:
    """``python -m pipeclock docs --quick --docs DOCS PAGES`` in this process (`run_here`: a quick build runs
    only the simulator's commands, which run in the builder's process anyway): its exit code and all it
    printed."""
    ran = run_here(shlex.join(["python", "-m", "pipeclock", "docs", "--quick", "--docs", str(docs), *pages]))
    return ran.returncode, ran.stdout + ran.stderr


def test_the_quick_build_redraws_the_simulator_figures_and_keeps_current_pages(tmp_path):
    for page in pages():
        shutil.copy(page, tmp_path / page.name)
    code, said = quick_build(tmp_path)
    assert code == 0, said
    simulated = {name for block in BLOCKS if block.simulator_only for _, name in block.notes.figures}
    assert "schedule_1f1b_p4_m8.png" in simulated and "schedule_compare_p4_m8.png" in simulated
    for name in simulated:
        assert (tmp_path / "figures" / name).read_bytes()[:4] == b"\x89PNG", name
    for page in pages():
        assert (tmp_path / page.name).read_text() == page.read_text(), f"{page.name} was out of date"


def test_a_build_of_named_pages_runs_only_their_commands_and_an_unknown_page_is_one_error(tmp_path):
    for page in pages():
        shutil.copy(page, tmp_path / page.name)
    code, said = quick_build(tmp_path, "lab6-1f1b")
    assert code == 0, said
    on_lab6 = [block for block in BLOCKS if block.page.name == "lab6-1f1b.md" and block.simulator_only]
    lab6 = {name for block in on_lab6 for _, name in block.notes.figures}
    assert lab6 and {path.name for path in (tmp_path / "figures").iterdir()} == lab6

    code, said = quick_build(tmp_path, "lab99")
    assert code == 2 and "no page lab99.md" in said and "Traceback" not in said


# --- the convention itself ------------------------------------------------------------------------


PRINTED = ["model: 16 layers", "parameters: 1,052,672", "", "step time 6.20 ms, 10,324 samples/s", "done"]


def test_a_quote_is_the_whole_output_unless_dots_mark_what_was_left_out():
    assert matched_lines(PRINTED, PRINTED, Notes()) == PRINTED
    with pytest.raises(Mismatch):
        matched_lines(["parameters: 1,052,672", "..."], PRINTED, Notes())  # the first line was left out
    assert matched_lines(["...", "parameters: 1,052,672", "..."], PRINTED, Notes())[1] == PRINTED[1]
    with pytest.raises(Mismatch):
        matched_lines(["model: 16 layers", "done"], PRINTED, Notes())  # lines between, no dots


def test_numbers_must_be_exact_except_measured_ones_in_lines_that_vary():
    timed = ["...", "step time 9.99 ms, 7,000 samples/s", "..."]
    with pytest.raises(Mismatch):
        matched_lines(timed, PRINTED, Notes())
    notes = Notes(vary=[re.compile("step time")])
    assert matched_lines(timed, PRINTED, notes)[1] == PRINTED[3], "the printed line replaces the quote"
    with pytest.raises(Mismatch):
        matched_lines(["...", "parameters: 1,052,673", "..."], PRINTED, notes)


def test_in_a_varying_line_counts_and_formula_values_stay_exact():
    notes = Notes(vary=[re.compile("bubble")])
    printed = ["  4  64 samples  249.2 ms  21.3%  bubble; formula (p-1)/(m+p-1) = 20.0%"]
    assert matched_lines(
        ["  4  64 samples  301.0 ms  19.0%  bubble; formula (p-1)/(m+p-1) = 20.0%"], printed, notes
    )
    for wrong in (
        "  8  64 samples  301.0 ms  19.0%  bubble; formula (p-1)/(m+p-1) = 20.0%",  # another m
        "  4  32 samples  301.0 ms  19.0%  bubble; formula (p-1)/(m+p-1) = 20.0%",  # another size
        "  4  64 samples  301.0 ms  19.0%  bubble; formula (p-1)/(m+p-1) = 33.3%",  # another formula value
    ):
        with pytest.raises(Mismatch):
            matched_lines([wrong], printed, notes)


def test_an_any_line_matches_a_line_with_the_same_label():
    notes = Notes(any=[re.compile(r"^rank \d \|")])
    printed = ["rank 0 |F0 ....B0 |", "rank 1 |..F0 B0 ..|"]
    assert matched_lines(["rank 0 |F0 B0 |", "rank 1 |F0 B0|"], printed, notes) == printed
    with pytest.raises(Mismatch):
        matched_lines(["rank 1 |F0 B0 |", "rank 0 |F0 B0|"], printed, notes)


def write_page(tmp_path: Path, prose: str) -> Path:
    page = tmp_path / "page.md"
    note = "<!-- docs\nvalue: step = step time ([\\d.]+) ms\n-->"
    page.write_text(f"{prose}\n\n{note}\n```console\n$ python -m pipeclock lab 1\nstep time 6.20 ms\n```\n")
    return page


def test_the_build_writes_a_cited_number_from_the_quote_and_the_check_names_a_stale_one(tmp_path):
    page = write_page(tmp_path, "A step took <!--=step-->9.99 ms.")
    filled, problems = prose_problems(page)
    assert "A step took <!--=step-->6.20 ms." in filled
    (problem,) = problems
    assert problem.endswith(f"page.md: the prose says step is 9.99; {read_blocks(page)[0]} prints 6.20")


def test_a_measured_value_outside_the_bounds_the_prose_states_fails(tmp_path):
    page = write_page(tmp_path, "A step takes <!--~step-->5 to 8 ms on this machine.")
    assert prose_problems(page)[1] == []
    (block,) = read_blocks(page)
    assert bounds_problems(block, ["step time 7.90 ms"]) == []
    (problem,) = bounds_problems(block, ["step time 8.10 ms"])
    assert "the prose bounds step to 5 to 8" in problem and "prints 8.10" in problem


def test_a_citation_of_a_value_no_block_names_is_a_page_error(tmp_path):
    page = write_page(tmp_path, "A step took <!--=steps-->6.20 ms.")
    with pytest.raises(PageError, match="cites steps"):
        prose_problems(page)


def test_the_build_rewrites_a_stale_number_from_the_run_and_fails_on_a_bound_it_leaves(tmp_path):
    command = "python -m pipeclock schedule gpipe --stages 2 --microbatches 4"
    note = "<!-- docs\nvalue: makespan = ^makespan +(\\d+)$\n-->"
    quote = f"{note}\n```console\n$ {command}\n...\nmakespan 15\n...\n```"
    page = tmp_path / "page.md"
    page.write_text(f"The step lasts <!--=makespan-->99 units.\n\n{quote}\n")
    code, said = quick_build(tmp_path)
    assert code == 0, said
    assert page.read_text().startswith("The step lasts <!--=makespan-->15 units.")
    page.write_text(f"The step lasts <!--~makespan-->10 to 12 units.\n\n{quote}\n")
    code, said = quick_build(tmp_path)
    assert code == 1 and "the prose bounds makespan to 10 to 12" in said and "prints 15" in said
