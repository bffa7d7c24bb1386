"""A headless Chromium driven over the DevTools protocol, through a pipe: no websocket, no new dependency.

Chromium started with ``--remote-debugging-pipe`` reads protocol commands on its file descriptor 3 and
writes answers and events on 4, each message JSON ended by a NUL byte. That is enough to open a page,
change its inputs, read what it shows, and take a screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--remote-debugging-pipe",
]


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page; ``timeout`` seconds for any answer."""

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 30.0) -> None:
        if CHROMIUM is None:
            raise BrowserError("no chromium on PATH")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="pipeclock-chromium-")
        to_chromium, self._commands = _pipe_above(10)
        self._answers, from_chromium = _pipe_above(10)
        self.process = subprocess.Popen(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: close() can end every process it started
            close_fds=False,  # Python's own descriptors close on exec anyway; 3 and 4 are to stay open
            preexec_fn=lambda: (os.dup2(to_chromium, 3), os.dup2(from_chromium, 4)),
        )
        os.close(to_chromium)
        os.close(from_chromium)
        self._next_id = 0
        self._buffer = b""
        self.events: list[dict] = []
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t["targetId"] for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", targetId=page, flatten=True)["sessionId"]

    def send(self, method: str, session: str | None = None, **params) -> dict:
        """Send one command and wait for its answer (events met meanwhile are kept in ``events``)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._read()
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def page(self, method: str, **params) -> dict:
        return self.send(method, self.session, **params)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, ready: str = "document.readyState === 'complete'") -> None:
        """Go to ``url`` and wait until the expression ``ready`` is true."""
        self.page("Page.navigate", url=url)
        deadline = time.monotonic() + self.timeout
        while not self.evaluate(ready):
            if time.monotonic() > deadline:
                raise BrowserError(f"{url} not ready after {self.timeout} s ({ready})")
            time.sleep(0.05)

    def screenshot(self, path: Path) -> Path:
        data = self.page("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):  # it may be gone already
            self.send("Browser.close")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        os.close(self._commands)
        os.close(self._answers)
        shutil.rmtree(self.profile, ignore_errors=True)

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise BrowserError(f"chromium did not answer within {self.timeout} s")
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium closed its pipe (exit code {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)


def _pipe_above(lowest: int) -> tuple[int, int]:
    """A pipe whose ends are numbered ``lowest`` or more: moving them to 3 and 4 clobbers neither."""
    read, write = os.pipe()
    ends = tuple(fcntl.fcntl(end, fcntl.F_DUPFD, lowest) for end in (read, write))
    os.close(read)
    os.close(write)
    return ends
