"""``pipeclock explore``: a page to play with the schedules, in a browser, with no process and no network.

python -m pipeclock explore                        # write the page and open it in the browser
python -m pipeclock explore --out explorer.html    # only write it
python -m pipeclock explore --serve                # serve it on localhost (for a browser elsewhere)

The page (``pipeclock/observe/explorer.py``) holds pipeclock's own schedules and times them by the
simulator's rules; it needs nothing else, so the file can be copied, mailed or opened offline.
"""

from __future__ import annotations

import argparse
import http.server
import sys
import tempfile
import time
import webbrowser
from pathlib import Path
from urllib.parse import urlencode

from pipeclock.cli.arguments import check_output, non_negative_float, positive_int
from pipeclock.engine.generators import SCHEDULES
from pipeclock.observe.explorer import Grid, page, write_page

DESCRIPTION = __doc__.split("\n\n")[0].replace("``", "")
SERVE_SECONDS = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", choices=list(SCHEDULES), help="the schedule shown first")
    parser.add_argument("--compare", metavar="NAME", choices=list(SCHEDULES), help="the one beside it")
    parser.add_argument("--stages", "-p", metavar="P", type=positive_int, help="stages shown first")
    parser.add_argument("--microbatches", "-m", metavar="M", type=positive_int, help="micro-batches")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="FILE", help="write the page there and open nothing")
    where.add_argument("--serve", action="store_true", help="serve the page on localhost, open nothing")
    parser.add_argument("--port", type=int, default=0, help="the port for --serve (0: any free one)")
    parser.add_argument(
        "--for", dest="serve_seconds", metavar="SECONDS", type=non_negative_float, default=SERVE_SECONDS,
        help="how long --serve serves before it ends by itself (Ctrl-C ends it sooner)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        _check_sizes(args, Grid())
    except ValueError as error:
        print(f"pipeclock explore: error: {error}", file=sys.stderr)
        return 2
    view = _view(args)
    if args.serve:
        return _serve(page(), view, args.port, args.serve_seconds)
    if args.out:
        try:
            check_output(args.out, "--out")
            written = write_page(args.out)
        except (ValueError, OSError) as error:
            print(f"pipeclock explore: error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {written}: open it in a browser{view and ' (with #' + view + ')'}")
        return 0
    written = write_page(Path(tempfile.gettempdir()) / "pipeclock-explorer.html")
    url = written.resolve().as_uri() + (f"#{view}" if view else "")
    if webbrowser.open(url):
        print(f"opened {url}")
    else:
        print(f"wrote {written}; no browser found here: open {url} yourself, or use --serve")
    return 0


def _check_sizes(args: argparse.Namespace, grid: Grid) -> None:
    """The page holds every schedule for p and m up to the grid's: a size past it would open on an empty
    view, so it is refused here, in one line."""
    for flag, value, largest in (
        ("-p", args.stages, grid.stages),
        ("-m", args.microbatches, grid.microbatches),
    ):
        if value is not None and value > largest:
            raise ValueError(f"{flag} {value}: the page holds {flag[1]} = 1 to {largest}")


def _view(args: argparse.Namespace) -> str:
    """What the page shows first, as its #fragment: only what the command line chose."""
    chosen = {
        "schedule": args.name,
        "compare": args.compare,
        "p": args.stages,
        "m": args.microbatches,
    }
    return urlencode({key: value for key, value in chosen.items() if value is not None})


def _serve(html: str, view: str, port: int, seconds: float) -> int:
    """Serve ``html`` at / on 127.0.0.1 until ``seconds`` have passed (or Ctrl-C)."""
    body = html.encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path.split("?")[0] in ("/", "/index.html")
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass  # a quiet terminal: the one line below says where the page is

    with http.server.ThreadingHTTPServer(("127.0.0.1", port), Page) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/" + (f"#{view}" if view else "")
        print(f"serving {url} for {seconds:g} s (Ctrl-C ends it)", flush=True)
        server.timeout = 0.25
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            server.handle_request()
    print("served; stopped")
    return 0
