"""The learner's file, loaded only where it is watched.

Importing a file runs whatever it has at module level: an endless loop, a ``sys.exit(0)``, an
``os._exit(3)``, a call of its own function at the bottom. Run in the checker's own process, the first
would hang it, the next two would end it with an exit code and no verdict (a pass, to a script), the last
would print tracebacks. So the file is first imported in a child process with a time limit (`probe`), and
each of those endings comes back as one line naming what the file did; the ranks import it again, as
watched as the rest of their run.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
import traceback
from pathlib import Path

from pipeclock import comms

IMPORT_LIMIT = 20.0  # seconds for the learner's file to import: far more than any plain file takes
GUARDED = ("init", "send_tensor", "isend_tensor", "recv_tensor", "barrier", "get_rank", "get_world_size",
           "get_prev_rank", "get_next_rank")  # fmt: skip
AT_THE_BOTTOM = 'code at module level runs on import: put it under `if __name__ == "__main__":`'


class LoadError(Exception):
    """The learner's file cannot give its function: ``str`` is the one line that says why."""


class TalksAtImport(Exception):
    """The learner's file used ``comms`` while being imported: it would talk to the other ranks then."""


def load_function(path: Path, name: str):
    """The learner's function ``name`` from the file at ``path`` (imported here: call it where watched)."""
    spec = importlib.util.spec_from_file_location(f"learner_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise LookupError(f"{shown(path)} defines no function {name}(...)")
    return function


def shown(path: Path) -> str:
    """``path`` relative to here when it is below here, else whole."""
    relative = os.path.relpath(path)
    return str(Path(path).resolve()) if relative.startswith("..") else relative


def probe(path: Path, name: str, limit: float = IMPORT_LIMIT) -> None:
    """Import ``path`` in a child process and find ``name`` there; `LoadError` with one line if the import
    raises, exits, ends the process, outlasts ``limit`` seconds, or the function is missing."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    reading, writing = context.Pipe(duplex=False)
    child = context.Process(target=_import_in_child, args=(str(path), name, writing), daemon=True)
    child.start()
    writing.close()
    timed_out = not reading.poll(limit)
    try:
        answer = None if timed_out else reading.recv()
    except EOFError:  # the child ended without a word: an os._exit
        answer = None
    finally:
        if timed_out:
            child.kill()
        child.join(timeout=10)
        reading.close()
    if answer is None:
        if not timed_out:
            raise LoadError(
                f"{shown(path)} ended the process with exit code {child.exitcode} while being imported "
                f"(an os._exit?); {AT_THE_BOTTOM}"
            )
        raise LoadError(
            f"{shown(path)} was still being imported after {limit:g}s (an endless loop at module level?); "
            f"{AT_THE_BOTTOM}"
        )
    if answer != "ok":
        raise LoadError(answer)


def line_by_line() -> None:
    """The learner's prints leave this watched child line by line, into a pipe too (``... | tee``): the
    child may end (``os._exit``) or be stopped before it could flush a buffer, and the lines with it."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)  # a text file's; not a StringIO's
    if reconfigure is not None:
        reconfigure(line_buffering=True)


def _import_in_child(path: str, name: str, answer) -> None:
    line_by_line()
    learner = Path(path)
    for call in GUARDED:
        setattr(comms, call, _refused(call))
    try:
        load_function(learner, name)
        text = "ok"
    except LookupError as error:
        text = str(error)
    except SyntaxError as error:
        text = f"{shown(learner)} cannot be loaded: SyntaxError: {error.msg} (line {error.lineno})"
    except TalksAtImport as error:
        text = f"{shown(learner)} calls {error} when imported{_where(error, learner)}; {AT_THE_BOTTOM}"
    except SystemExit as error:
        code = f"sys.exit({error.code!r})"
        text = f"{shown(learner)} calls {code} when imported{_where(error, learner)}; {AT_THE_BOTTOM}"
    except BaseException as error:
        text = (
            f"{shown(learner)} raised {type(error).__name__}: {error} when imported{_where(error, learner)}; "
            f"{AT_THE_BOTTOM}"
        )
    answer.send(text)
    answer.close()
    os._exit(0)  # nothing of the learner's (threads, atexit) runs after the answer


def _refused(call: str):
    def refuse(*args, **kwargs):
        raise TalksAtImport(f"comms.{call}()")

    return refuse


def _where(error: BaseException, learner: Path) -> str:
    """`` (line 60: `main()`)``: the module-level line of the learner's file that led to ``error``."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if Path(f.filename).resolve() == learner.resolve()
    ]
    if not frames:
        return ""
    top = next((f for f in frames if f.name == "<module>"), frames[0])
    return f" (line {top.lineno}: `{(top.line or '').strip()}`)"
