"""The explorer's page shows what pipeclock's simulator computes, redraws when its inputs change, and needs
no network: checked in a real headless Chromium (tools/browser.py), and the command that writes it."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import urllib.error
import urllib.request
from itertools import product
from pathlib import Path

import pytest

from pipeclock.cli.dispatch import main
from pipeclock.engine.generators import (
    SCHEDULES,
    bubble_formula,
    chunks_of,
    formula_assumption,
    generate,
    supports_chunks,
)
from pipeclock.observe.explorer import Grid, page, schedule_data, write_page
from pipeclock.observe.simulate import simulate
from tools.browser import CHROMIUM, Browser
from tools.explorer_figure import READY, draw

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
# (p, m, chunks for interleaving, costs, message): m < p, m = p, m > p, uneven costs, slow messages.
GRID = [
    (1, 1, 2, DEFAULT_COSTS, 0.0),
    (2, 3, 2, DEFAULT_COSTS, 0.5),
    (3, 2, 3, {"F": 1.0, "B": 3.0, "I": 1.5, "W": 1.5}, 0.0),
    (4, 8, 2, DEFAULT_COSTS, 0.0),
    (4, 4, 4, {"F": 0.7, "B": 1.9, "I": 1.1, "W": 0.3}, 0.25),
    (5, 7, 2, {"F": 2.0, "B": 2.0, "I": 0.0, "W": 2.0}, 1.0),
    (8, 16, 3, DEFAULT_COSTS, 0.1),
]
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; .ci/run installs it)"
)


def chunks_for(name: str, chosen: int) -> int:
    return chunks_of(name) or (chosen if supports_chunks(SCHEDULES[name]) else 1)


def simulated(name: str, p: int, m: int, chunks: int, costs: dict, message: float) -> dict | None:
    """The simulator's figures for what the page shows (costs are a stage's; a chunk does 1/chunks)."""
    try:
        schedule = generate(name, p, m, chunks)
    except ValueError:
        return None
    timeline = simulate(schedule, {op: cost / chunks for op, cost in costs.items()}, comm_latency=message)
    return {
        "makespan": timeline.makespan,
        "bubble": timeline.bubble_share,
        "peaks": [timeline.peak_live(rank) for rank in range(p)],
        "formula": bubble_formula(name, p, m, chunks),
    }


def view(p: int, m: int, chunks: int, costs: dict, message: float, **shown: str) -> str:
    settings = {**shown, "p": p, "m": m, "chunks": chunks, **costs, "message": message}
    return "&".join(f"{key}={value}" for key, value in settings.items())


def same_figures(shown: dict, expected: dict) -> bool:
    close = all(
        math.isclose(shown[k], expected[k], rel_tol=1e-12, abs_tol=1e-12) for k in ("makespan", "bubble")
    )
    peaks = len(shown["peaks"]) == len(expected["peaks"]) and all(
        math.isclose(a, b, abs_tol=1e-12) for a, b in zip(shown["peaks"], expected["peaks"], strict=True)
    )
    return close and peaks and math.isclose(shown["formula"], expected["formula"], rel_tol=1e-12)


TABLE = """[...document.querySelectorAll('#every tr[data-schedule]')].map(row => ({
  name: row.dataset.schedule, chunks: Number(row.dataset.chunks), shown: row.dataset.makespan !== undefined,
  makespan: Number(row.dataset.makespan), bubble: Number(row.dataset.bubble),
  peaks: row.dataset.peaks ? JSON.parse(row.dataset.peaks) : [], formula: Number(row.dataset.formula)}))"""


def side(browser: Browser, which: str) -> dict:
    """What side ``which`` (a or b) shows: its schedule, its redraw count, and its figures."""
    figures = browser.evaluate(
        f"""(() => {{ const side = document.getElementById('side-{which}'); const value = name =>
        side.querySelector(`[data-figure="${{name}}"]`)?.dataset.value;
        return {{ name: side.dataset.schedule, draws: Number(side.dataset.draws),
        makespan: Number(value('makespan')), bubble: Number(value('bubble')),
        formula: Number(value('formula')), caveat: value('caveat') || null,
        peaks: JSON.parse(value('peaks') || '[]'), title: side.querySelector('h2')?.textContent }}; }})()"""
    )
    return figures


def set_input(browser: Browser, field: str, value: str) -> None:
    """Type ``value`` into the page's input ``field``, as a person would (an input event follows)."""
    browser.evaluate(
        f"(() => {{ const input = document.getElementById({json.dumps(field)});"
        f" input.value = {json.dumps(value)};"
        " input.dispatchEvent(new Event('input', { bubbles: true })); })()"
    )


@pytest.fixture(scope="module")
def page_file(tmp_path_factory) -> Path:
    return write_page(tmp_path_factory.mktemp("explorer") / "explorer.html")


@pytest.fixture(scope="module")
def browser():
    opened = Browser(width=1200, height=800)
    yield opened
    opened.close()


def open_at(browser: Browser, page_file: Path, settings: str) -> None:
    browser.open(f"{page_file.as_uri()}#{settings}", READY)


@needs_chromium
def test_1f1b_zb_h1_and_zb_v_at_p4_m8_show_the_simulators_bubble_and_makespan(browser, page_file):
    for first, second in (("1f1b", "zb-h1"), ("zb-v", "1f1b")):
        open_at(browser, page_file, view(4, 8, 2, DEFAULT_COSTS, 0.0, schedule=first, compare=second))
        for which, name in (("a", first), ("b", second)):
            shown = side(browser, which)
            assert shown["name"] == name
            assert same_figures(shown, simulated(name, 4, 8, chunks_for(name, 2), DEFAULT_COSTS, 0.0)), shown
    figures = browser.evaluate("document.querySelector('#side-a dl').textContent")
    assert "makespan25.5" in figures.replace(" ", "") and "bubble5.9%" in figures.replace(" ", "")


@needs_chromium
def test_a_formula_that_does_not_apply_says_so_beside_it_and_the_address_key_is_the_labels(
    browser, page_file
):
    open_at(browser, page_file, view(4, 4, 2, DEFAULT_COSTS, 0.5, schedule="zb-v", compare="zb-v"))
    assert side(browser, "a")["caveat"] == "m ≥ 2p"  # 4 micro-batches on 4 ranks: no steady state
    shown = browser.evaluate("document.querySelector('#side-a [data-figure=caveat]').textContent")
    assert shown == "the formula assumes m ≥ 2p, not so here: read the simulated bubble"
    assert browser.evaluate("document.getElementById('message').value") == "0.5"
    label = browser.evaluate("document.getElementById('message').parentElement.textContent")
    assert label.strip() == "message", "the address key (message=) is the label's word"
    set_input(browser, "m", "8")
    assert side(browser, "a")["caveat"] is None


@needs_chromium
def test_on_a_grid_of_cases_every_schedules_figures_are_the_simulators(browser, page_file):
    open_at(browser, page_file, view(*GRID[0]))
    for p, m, chunks, costs, message in GRID:
        browser.evaluate(f"location.hash = {json.dumps(view(p, m, chunks, costs, message))}")
        rows = {row["name"]: row for row in browser.evaluate(TABLE)}
        assert list(rows) == list(SCHEDULES)
        for name, row in rows.items():
            expected = simulated(name, p, m, chunks_for(name, chunks), costs, message)
            assert row["chunks"] == chunks_for(name, chunks)
            assert row["shown"] == (expected is not None), (name, p, m)
            if expected is not None:
                assert same_figures(row, expected), (name, p, m, chunks, costs, message, row, expected)


@needs_chromium
def test_the_page_holds_the_generators_schedules_action_for_action(browser, page_file):
    open_at(browser, page_file, "")
    for name, (p, m) in product(SCHEDULES, [(3, 5), (4, 8)]):
        chunks = chunks_for(name, 3)
        held = browser.evaluate(f"JSON.stringify(lookUp({json.dumps(name)}, {p}, {m}, {chunks}))")
        rows = json.loads(held)["rows"]
        expected = [
            [[a.op, a.microbatch, a.chunk, a.overlap] for a in row] for row in generate(name, p, m, chunks)
        ]
        assert [[[a["op"], a["mb"], a["chunk"], a["overlap"]] for a in row] for row in rows] == expected


@needs_chromium
def test_changing_p_m_or_a_cost_redraws_with_the_simulators_figures(browser, page_file):
    open_at(browser, page_file, view(4, 8, 2, DEFAULT_COSTS, 0.0, schedule="zb-h1", compare="1f1b"))
    costs, p, m, message = dict(DEFAULT_COSTS), 4, 8, 0.0
    before = side(browser, "a")
    for field, value in (("p", "5"), ("m", "3"), ("W", "2.5"), ("F", "0.5"), ("message", "0.75")):
        set_input(browser, field, value)
        p, m = (int(value) if field == key else old for key, old in (("p", p), ("m", m)))
        costs = {**costs, field: float(value)} if field in costs else costs
        message = float(value) if field == "message" else message
        after = side(browser, "a")
        assert after["draws"] == before["draws"] + 1, f"changing {field} did not redraw"
        assert same_figures(after, simulated("zb-h1", p, m, 1, costs, message)), (field, after)
        assert same_figures(side(browser, "b"), simulated("1f1b", p, m, 1, costs, message))
        assert f"{field}={value}" in browser.evaluate("location.hash"), "the address keeps the view"
        before = after
    set_input(browser, "p", "0")
    assert (
        browser.evaluate("document.getElementById('problem').textContent") == "p must be a whole number >= 1"
    )


@needs_chromium
def test_the_page_loads_and_works_with_the_network_off(browser, page_file):
    offline = {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1}
    browser.page("Network.enable")
    browser.page("Network.emulateNetworkConditions", **offline)
    try:
        browser.open("about:blank")  # so that the page is loaded again, not only its #fragment changed
        browser.events.clear()
        open_at(browser, page_file, view(4, 8, 2, DEFAULT_COSTS, 0.0, schedule="zb-v", compare="1f1b"))
        assert same_figures(side(browser, "a"), simulated("zb-v", 4, 8, 2, DEFAULT_COSTS, 0.0))
        sent = [
            e["params"]["request"]["url"]
            for e in browser.events
            if e["method"] == "Network.requestWillBeSent"
        ]
        assert sent and all(url.startswith("file://") for url in sent), sent
    finally:
        browser.page("Network.emulateNetworkConditions", **{**offline, "offline": False})
        browser.page("Network.disable")
    html = page_file.read_text()
    assert not re.search(r"""\b(src|href)\s*=|@import|url\(|fetch\(|XMLHttpRequest""", html), (
        "all of it inline"
    )


@needs_chromium
def test_the_docs_screenshot_is_drawn_from_the_page(browser, tmp_path):
    drawn = draw(tmp_path / "explorer.png", browser)
    header = drawn.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")
    assert width >= 1000 and height >= 600
    assert "figures/explorer.png" in (ROOT / "docs" / "explorer.md").read_text()


def test_explore_out_writes_one_self_contained_page(tmp_path, capsys):
    out = tmp_path / "sub" / "explorer.html"
    assert main(["explore", "--out", str(out), "zb-v", "--compare", "1f1b", "-p", "4"]) == 0
    assert (
        capsys.readouterr().out
        == f"wrote {out}: open it in a browser (with #schedule=zb-v&compare=1f1b&p=4)\n"
    )
    assert out.read_text() == page()
    assert main(["explore", "--out", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"pipeclock explore: error: --out {tmp_path}: that is a folder; name a file\n"
    )


def test_explore_refuses_a_size_the_page_does_not_hold_in_one_line(tmp_path, capsys):
    grid = Grid()
    for flag, largest in (("-p", grid.stages), ("-m", grid.microbatches)):
        out = tmp_path / "explorer.html"
        assert main(["explore", "--out", str(out), flag, str(largest + 1)]) == 2
        said = capsys.readouterr()
        assert (
            said.err
            == f"pipeclock explore: error: {flag} {largest + 1}: the page holds {flag[1]} = 1 to {largest}\n"
        )
        assert said.out == "" and not out.exists()


def test_the_page_carries_a_caveat_exactly_where_the_formula_is_not_the_simulators_bubble():
    cases = schedule_data(Grid(stages=6, microbatches=12, chunks=3))["cases"]
    caveats = 0
    for key, case in cases.items():
        name, p, m, chunks = key.split("/")
        p, m, chunks = int(p), int(m), int(chunks)
        if "error" in case:
            continue
        assert case.get("caveat") == formula_assumption(name, p, m, chunks), key
        if "caveat" in case:
            caveats += 1
            continue
        exact = simulated(name, p, m, chunks, DEFAULT_COSTS, 0.0)
        assert math.isclose(exact["bubble"], exact["formula"], abs_tol=1e-12), key
    assert cases["zb-v/4/4/2"]["caveat"] == "m ≥ 2p" and "caveat" not in cases["zb-v/4/8/2"]
    assert caveats > 0


def test_the_page_holds_every_schedule_on_its_grid_and_stays_small():
    html = page()
    grid = Grid()
    assert len(html) < 800_000
    data = json.loads(re.search(r'id="explorer-data" type="application/json">(.*?)</script>', html, re.S)[1])
    assert list(data["schedules"]) == list(SCHEDULES)
    assert f"zb-v/{grid.stages}/{grid.microbatches}/2" in data["cases"]
    assert f"interleaved-1f1b/{grid.stages}/{grid.microbatches}/{grid.chunks}" in data["cases"]


def test_explore_serve_answers_on_localhost_and_ends_by_itself():
    server = subprocess.Popen(
        [sys.executable, "-m", "pipeclock", "explore", "--serve", "--for", "3", "1f1b"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        first = server.stdout.readline()
        url = re.match(r"serving (http://127\.0\.0\.1:\d+/)#schedule=1f1b for 3 s", first)
        assert url, first
        with urllib.request.urlopen(url[1], timeout=10) as answer:
            assert answer.read().decode() == page()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url[1] + "other", timeout=10)
        assert server.wait(timeout=20) == 0
        assert server.stdout.read() == "served; stopped\n"
    finally:
        server.kill()
        server.wait()
