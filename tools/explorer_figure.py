"""The explorer's picture for the docs: the page, opened in headless Chromium, as a PNG.

python -m tools.explorer_figure                      # docs/figures/explorer.png
python -m tools.explorer_figure /tmp/explorer.png    # elsewhere
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from pipeclock.observe.explorer import write_page
from tools.browser import CHROMIUM, Browser

FIGURE = Path(__file__).resolve().parents[1] / "docs" / "figures" / "explorer.png"
VIEW = "schedule=1f1b&compare=zb-v&p=4&m=8"  # what the docs show: 1F1B's bubble, and ZB-V's nearly none
READY = "document.body !== null && document.body.dataset.ready === 'true'"


def draw(path: Path, browser: Browser, view: str = VIEW) -> Path:
    """Write the page, open it at ``view`` (its #fragment) in ``browser``, and save what it shows."""
    with tempfile.TemporaryDirectory() as folder:
        page = write_page(Path(folder) / "explorer.html")
        browser.open(f"{page.as_uri()}#{view}", READY)
        path.parent.mkdir(parents=True, exist_ok=True)
        return browser.screenshot(path)


def main(argv: list[str]) -> int:
    if CHROMIUM is None:
        print("tools.explorer_figure: no chromium on PATH (apt-get install chromium); the figure is kept")
        return 0
    browser = Browser(width=1200, height=800)
    try:
        print(f"drew {draw(Path(argv[0]) if argv else FIGURE, browser)}")
    finally:
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
