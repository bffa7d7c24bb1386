"""Ctrl-C and torchrun's SIGTERM end a command with one line and exit code 128 + the signal, no traceback.

Ctrl-C in a terminal sends SIGINT to torchrun and to every rank at once; torchrun then passes the signal
on, and a job scheduler (or torchrun, when another rank failed) stops ranks with SIGTERM. Both become
``Interrupted``, a ``KeyboardInterrupt`` that remembers its signal, so a command has one place to catch
them. The signal received is also remembered: a rank whose peer stopped first sees a broken connection
before its own signal is handled, and that, too, is an interruption rather than a failure.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

_received: int | None = None


class Interrupted(KeyboardInterrupt):
    """Raised by the handlers that ``signals_caught`` installs."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def signals_caught() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise ``Interrupted``; the former handlers come back after.

    Only the main thread may set handlers: elsewhere (a test calling a command from a thread) the block
    runs with the handlers as they are.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = (signal.SIGINT, signal.SIGTERM)
    former = {signum: signal.signal(signum, _raise_interrupted) for signum in caught}
    try:
        yield
    finally:
        for signum, handler in former.items():
            if handler is not None:  # None: a handler set outside Python, which cannot be put back
                signal.signal(signum, handler)


def _raise_interrupted(signum: int, frame) -> None:
    """The first signal interrupts; later ones are ignored so that the report and the clean-up finish.

    Under torchrun a rank gets Ctrl-C's SIGINT twice (from the terminal and passed on by torchrun): the
    second must not interrupt the handling of the first. They are ignored by a handler that does nothing,
    not by ``SIG_IGN``: a signal that arrived with the first, still pending when its handler becomes
    ``SIG_IGN``, makes Python raise "OSError: Signal 15 ignored due to race condition". A stuck clean-up
    is still bounded: torchrun sends SIGKILL after its grace period.
    """
    global _received
    _received = signum
    for caught in (signal.SIGINT, signal.SIGTERM):
        signal.signal(caught, _ignore)
    raise Interrupted(signum)


def _ignore(signum: int, frame) -> None:
    """A signal after the first: the interruption is being handled already."""


def received() -> int | None:
    """The signal that interrupted this process, if one did."""
    return _received


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal number, as a shell reports a process the signal ended (130 for Ctrl-C)."""
    return 128 + getattr(interrupt, "signum", signal.SIGINT)


def run_as_script(main: Callable[[], object]) -> None:
    """Run a script's ``main`` (a lab's) so that Ctrl-C or SIGTERM ends each rank with one line,
    ``rank R: interrupted``, and exit code 128 + the signal, rather than with a traceback per rank.

    A rank whose peer stopped first sees a broken connection before its own signal is handled; that
    counts as the interruption too. Any other error keeps its traceback: in a lab it is a bug.

    The process then ends at once (``os._exit``), its output flushed: an interrupted step leaves messages
    in flight, and tearing down a communicator that still holds them can abort in C++ with a line of its
    own ("terminate called without an active exception") after the rank's one line.
    """
    with signals_caught():
        try:
            main()
            return
        except KeyboardInterrupt as interrupt:
            code = exit_code(interrupt)
        except Exception:
            if _received is None:
                raise
            code = 128 + _received
    print(f"rank {os.environ.get('RANK', '0')}: interrupted", file=sys.stderr)
    end_now(code)


def end_now(code: int) -> NoReturn:
    """End an interrupted process at once, its output flushed (``run_as_script``, ``python -m pipeclock``):
    not in the teardown of communicators that still hold an interrupted step's messages, nor in the
    interpreter's exit, which a rank stopped among peers should not wait for (``comm_blame.end_at_once``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
