"""``pipeclock docs``: rebuild the course pages' figures and quoted outputs from real runs.

python -m pipeclock docs            # every command the pages quote (labs included): a few minutes
python -m pipeclock docs --quick    # only the simulator's commands and tables: seconds
python -m pipeclock docs lab5-gpipe # only the commands one page quotes

Every command quoted in ``docs/*.md`` is run again; its output replaces the quoted one (keeping the
lines the page chose to show) and the figures it draws are copied into ``docs/figures/``; the numbers
the prose cites are written from those runs, and a measured one outside the bounds its sentence gives
fails the build (``tools/docs_prose.py``). How a page quotes a command is described in
``tools/docs_build.py``: the build is course tooling, in the source checkout, not in the library.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeclock.cli.checkout import ROOT, import_from_checkout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pages", nargs="*", metavar="PAGE", help="rebuild only these pages, e.g. lab5-gpipe (default: all)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the commands that start no process (python -m pipeclock schedule)",
    )
    docs = ROOT / "docs"
    parser.add_argument("--docs", type=Path, default=docs, metavar="DIR", help=f"the pages (default {docs})")


def run(args: argparse.Namespace) -> int:
    docs_build = import_from_checkout("tools.docs_build", "docs")
    docs_tables = import_from_checkout("tools.docs_tables", "docs")
    if not sorted(args.docs.glob("*.md")):
        print(f"pipeclock docs: error: --docs {args.docs}: no pages (*.md) there", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        outcomes = docs_build.build(args.docs, quick=args.quick, only=args.pages)
    except (docs_build.PageError, docs_tables.TableError) as error:  # a page that breaks the convention
        print(f"pipeclock docs: error: {error}")
        return 2
    failed = [outcome for outcome in outcomes if outcome.problem is not None and not outcome.prose]
    prose = [outcome.problem for outcome in outcomes if outcome.prose]
    figures = sum(len(outcome.figures) for outcome in outcomes)
    print(
        f"\n{len(outcomes) - len(prose)} commands run, {figures} figures drawn into {args.docs / 'figures'} "
        f"in {time.perf_counter() - start:.0f} s"
    )
    if failed:
        print(f"pipeclock docs: {len(failed)} quoted outputs no longer match (those blocks are unchanged):")
        for outcome in failed:
            print(f"  {outcome.block}")
    if prose:
        print(f"pipeclock docs: {len(prose)} numbers in the prose disagree with the output they describe:")
        for problem in prose:
            print(f"  {problem}")
    return 1 if failed or prose else 0
