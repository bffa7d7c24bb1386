"""The README and the guide say what the code does: the README's demo is `make demo`, every page's Python
runs, its commands parse, its links lead somewhere, and the layout names every module.

The pages are README.md and every docs/guide/*.md: what the README once held in depth lives there, held
to the same checks."""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ok

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
GUIDE = ROOT / "docs" / "guide"
PAGES = [ROOT / "README.md", *sorted(GUIDE.glob("*.md"))]


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced(language: str, text: str) -> list[str]:
    """The code blocks in ``language`` of a page's ``text``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def snippet(page: str) -> str:
    """The one Python block of a guide page (``own-model.md``): found by its page, not its place."""
    blocks = fenced("python", (GUIDE / page).read_text())
    assert len(blocks) == 1, f"docs/guide/{page} has {len(blocks)} Python blocks, not one"
    return blocks[0]


def commands(block: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def make_recipe(target: str) -> list[str]:
    """The recipe lines of a Makefile target, with ``$(BIN)`` written as the README writes it."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE).group(1)
    return [line.strip().replace("$(BIN)", ".venv/bin") for line in recipe.splitlines()]


def test_the_readme_shows_exactly_what_make_demo_runs():
    section = README[README.index("## What `make demo` shows") :]
    shown = commands(re.search(r"```sh\n(.*?)```", section, re.DOTALL).group(1))
    assert [shlex.split(line) for line in shown] == [shlex.split(line) for line in make_recipe("demo")]
    for written in ("--trace", "--png"):  # the files the prose says the demo writes
        path = shlex.split(shown[0])[shlex.split(shown[0]).index(written) + 1]
        assert f"`{path}`" in section


# --- every command the pages show is one pipeclock accepts --------------------------------------------


def pipeclock_words(line: str) -> tuple[str, list[str]] | None:
    """The pipeclock command and its arguments in a page's line, or None for other tools (make...)."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words.pop(0)  # environment variables
    if "pipeclock" not in words:
        return None
    after = words[words.index("pipeclock") + 1 :]
    return after[0], after[1:]


def parse(command: str, arguments: list[str]) -> argparse.Namespace:
    from pipeclock.cli import dispatch

    parser = argparse.ArgumentParser(prog=f"pipeclock {command}", exit_on_error=False)
    dispatch._command_module(command).add_arguments(parser)
    return parser.parse_args(arguments)


def shown_commands(page: Path) -> list[tuple[str, list[str]]]:
    blocks = fenced("sh", page.read_text())
    return [found for block in blocks for line in commands(block) if (found := pipeclock_words(line))]


def test_every_pipeclock_command_in_the_readme_and_the_guide_parses():
    shown = {relative(page): shown_commands(page) for page in PAGES}
    assert len(shown["README.md"]) >= 3, "the README's tour was found"
    assert sum(map(len, shown.values())) >= 30, "the pages' command lines were found"
    for page, found in shown.items():
        for command, arguments in found:
            try:
                parse(command, arguments)
            except (argparse.ArgumentError, SystemExit) as error:
                pytest.fail(f"{page}: pipeclock {command} {shlex.join(arguments)}: {error}")


# --- the Python snippets run, as they are, on real processes ------------------------------------------


RUN = ("own-model.md", "axes.md", "hf-models.md")  # the pages with a script to copy, one each
INTERLEAVED = {"num_stages=world)": "num_stages=world, chunks=2)", '"1f1b"': '"interleaved-1f1b"'}


def with_changes(snippet: str, changes: dict[str, str]) -> str:
    for old, new in changes.items():
        assert old in snippet, f"the own-model snippet no longer has {old!r}"
        snippet = snippet.replace(old, new)
    return snippet


def run_snippets(rank: int, world: int, snippets: list[str], workdir: str) -> list[dict]:
    """Each snippet run as a script would run it on this rank, in ``workdir``; what its optimizer and
    pipeline hold.

    The snippets share this launch's process group: a snippet's ``comms.shutdown()`` is skipped, since
    leaving the group and joining again at once on the same port can race with the other rank.
    """
    from pipeclock import comms

    os.chdir(workdir)
    leave, comms.shutdown = comms.shutdown, lambda: None
    results = []
    try:
        for snippet in snippets:
            scope: dict = {"__name__": "__main__"}
            exec(compile(snippet, "docs/guide", "exec"), scope)
            optimized = {id(p) for group in scope["optimizer"].param_groups for p in group["params"]}
            held = {id(p) for chunk in scope["pipe"].chunks for p in chunk.parameters()}
            chunks = len(scope["pipe"].chunks)
            results.append({"loss": scope["loss"], "chunks": chunks, "all": optimized == held})
            if "hf" in scope:  # the HF snippet: its stage's trained weights, to find in its export
                results[-1]["weights"] = {n: p.detach() for n, p in scope["stage"].named_parameters()}
    finally:
        comms.shutdown = leave
    return results


def test_every_python_snippet_of_the_pages_is_one_that_runs():
    """A script added to the README or a guide page is run below, or this fails: none goes untested."""
    shown = {relative(page) for page in PAGES if fenced("python", page.read_text())}
    assert shown == {f"docs/guide/{page}" for page in RUN}, "a page's script is run below, one a page"


def test_the_guides_python_snippets_run_and_optimize_every_chunk(tmp_path):
    """And the HF snippet's ``hf.save_pretrained`` writes what ``transformers`` reads, with the trained
    weights of both ranks' stages."""
    from transformers import AutoModelForCausalLM

    own_model, mesh, hf_model = (snippet(page) for page in RUN)  # any Sequential, the mesh, HF
    snippets = [own_model, with_changes(own_model, INTERLEAVED), mesh, hf_model]
    ranks = run_ok(run_snippets, 2, snippets, str(tmp_path), timeout=60.0)
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf-out"), local_files_only=True)
    state = saved.state_dict()
    for results in ranks:
        assert all(torch.equal(t, state[name]) for name, t in results[-1]["weights"].items())
    for rank, results in enumerate(ranks):
        assert [result["chunks"] for result in results] == [1, 2, 1, 1], rank
        assert all(result["all"] for result in results), "the optimizer holds every chunk's parameters"
        assert all(result["loss"] == other["loss"] for result, other in zip(results, ranks[0], strict=True))


# --- what the pages point to exists ------------------------------------------------------------------


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def links(page: Path) -> list[tuple[str, Path, str]]:
    """A page's links as written, each with the file it leads to (the page itself for ``#anchor``) and
    the anchor, or ""."""
    found = []
    for target in re.findall(r"\]\(([^)]+)\)", page.read_text()):
        if "://" not in target:
            path, _, anchor = target.partition("#")
            found.append((target, (page.parent / path).resolve() if path else page, anchor))
    return found


def test_every_link_and_anchor_in_the_readme_and_the_guide_exists():
    for page in PAGES:
        for target, path, anchor in links(page):
            where = f"{relative(page)} links to {target}"
            assert path.exists(), f"{where}: {path} is missing"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", path.read_text(), re.MULTILINE)
                assert anchor in {slug(heading) for heading in headings}, f"{where}: no such heading"


def test_the_guide_index_lists_every_guide_page():
    listed = {path for _, path, _ in links(GUIDE / "index.md")}
    assert {page for page in PAGES[1:] if page.name != "index.md"} <= listed


def layout_listing() -> set[str]:
    """The modules (and folders, ending in /) the guide's layout names, as paths under pipeclock/."""
    block = (GUIDE / "layout.md").read_text().split("```")[1]
    listed, folder = set(), ""
    for line in block.splitlines()[2:]:  # after the opening fence and "pipeclock/"
        indent, first = len(line) - len(line.lstrip()), re.split(r"\s{2,}", line.strip())[0]
        if indent == 0:
            break
        if indent == 2 and first.endswith("/"):
            folder = first
            continue
        names = re.findall(r"\w+\.py|\w+/", first)
        listed |= {(folder if indent > 2 else "") + name for name in names}
    return listed


def test_the_guides_layout_names_every_module_and_only_real_ones():
    listed = layout_listing()
    modules = {
        str(path.relative_to(ROOT / "pipeclock"))
        for path in (ROOT / "pipeclock").rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    folders = {name for name in listed if name.endswith("/")}
    unlisted = {m for m in modules - listed if not any(m.startswith(folder) for folder in folders)}
    assert not unlisted, f"modules docs/guide/layout.md does not name: {sorted(unlisted)}"
    assert not {name for name in listed - folders if name not in modules}, "the layout names missing modules"
