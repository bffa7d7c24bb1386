"""The command line's shared parts: checks for numeric flags, one-line errors, help that shows defaults.

A value that cannot work (``--steps 0``, ``--timeout -1``) is refused while the command line is read,
before torch or any process group starts, as ``pipeclock train: error: argument --steps: must be a
positive integer, got 0`` and exit code 2. The checks are argparse ``type=`` functions, so every command
states its limits where it declares its flags.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def _number(kind: type, test: Callable[[float], bool], wanted: str) -> Callable[[str], int | float]:
    """An argparse ``type``: ``text`` read as ``kind`` and passing ``test``, else "must be <wanted>"."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = wanted.replace(" ", "_")
    return parse


positive_int = _number(int, lambda value: value > 0, "a positive integer")
non_negative_int = _number(int, lambda value: value >= 0, "an integer >= 0")
positive_float = _number(float, lambda value: value > 0, "a number > 0")
non_negative_float = _number(float, lambda value: value >= 0, "a number >= 0")
probability = _number(float, lambda value: 0 <= value < 1, "a number in [0, 1)")


class Parser(argparse.ArgumentParser):
    """A parser whose errors are one line (``prog: error: ...``, exit 2) and whose help shows defaults.

    argparse prints the whole usage before an error; for ``train`` that is a dozen lines hiding the one
    that matters. ``--help`` still shows it.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        # argparse takes "-1e-3" for an option ("--lr: expected one argument"); it is a negative number,
        # which the flag's own check then names.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    # A command's parser refuses words it does not know itself, rather than hand them back to the
    # top-level parser, whose error would name neither the command nor the flag it is close to.
    strict = False
    # A command's hook to widen its own arguments before they are read (train's --config file).
    expand_arguments: Callable[[argparse.ArgumentParser, list[str]], list[str]] | None = None

    def parse_known_args(self, args=None, namespace=None):
        if self.expand_arguments is not None:
            try:
                args = self.expand_arguments(self, list(sys.argv[1:] if args is None else args))
            except ValueError as error:
                self.error(str(error))
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self.strict:  # a command's own parser: the error in its name, with a hint
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._nearest(extras)}")
        return namespace, extras

    def _nearest(self, extras: list[str]) -> str:
        """`` (did you mean --steps?)`` for the first unknown flag close to one of this command's."""
        flags = [flag for action in self._actions for flag in action.option_strings]
        for word in extras:
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.7)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _print_message(self, message: str, file=None) -> None:
        """Under torchrun every rank reads the same command line: rank 0 alone shows its help or error."""
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Like ``ArgumentDefaultsHelpFormatter``, but a help text that already speaks of its default (or
    says the option is required) keeps its own words (``default 8, fewer if ...``), an unset option says
    ``none`` and on/off flags say nothing (absent means off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not shows_default(action) or "default" in text.lower() or "required" in text.lower():
            return text
        shown = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})"


def shows_default(action: argparse.Action) -> bool:
    """Whether an option takes a value, so that its default is worth saying."""
    if action.default is argparse.SUPPRESS or action.nargs == 0:
        return False  # --help, and flags such as store_true or store_const
    return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)


def check_output(path: str | os.PathLike, option: str, folder: bool = False) -> None:
    """``ValueError`` naming ``option`` and ``path`` if no file (or, with ``folder``, no folder) can be
    written there.

    Checked before the work that produces it, which may take a long time: a figure refused after an hour
    of training is an hour lost. The check writes, as the user this process runs as: a probe file (with a
    few bytes, so a full disk shows) is created and removed in the folder the output goes to, or, where
    that folder does not exist yet, a probe folder in the nearest one that does (the writers create the
    rest). Asking permission bits (``os.access``) is not enough: root passes them everywhere, yet cannot
    write to ``/proc``, a read-only mount or a full disk. An existing file is opened for appending (and
    left as it was), since the writer will replace it. Nothing is left behind.
    """
    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        raise ValueError(
            f"{option} {path}: that is a {'file' if folder else 'folder'}; name a {_kind(folder)}"
        )
    home = target if folder else target.parent  # the folder the output goes in
    existing = home
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {path}: {existing} is a file, so nothing can be created under it")
    try:
        _probe(existing, create_folder=existing != home)
        if target.is_file():
            open(target, "ab").close()
    except OSError as error:
        where = f"to {target}" if target.is_file() else f"in {existing}"
        raise ValueError(f"{option} {path}: cannot write {where} ({error.strerror})") from None


_PROBE = b"pipeclock checks that outputs can be written\n" * 64


def _probe(folder: Path, create_folder: bool) -> None:
    """Create and remove a probe file in ``folder`` (inside a probe folder, with ``create_folder``)."""
    inside = Path(tempfile.mkdtemp(prefix=".pipeclock-probe-", dir=folder)) if create_folder else folder
    try:
        descriptor, name = tempfile.mkstemp(prefix=".pipeclock-probe-", dir=inside)
        try:
            os.write(descriptor, _PROBE)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
            os.unlink(name)
    finally:
        if create_folder:
            os.rmdir(inside)


def _kind(folder: bool) -> str:
    return "folder" if folder else "file"


def add_link_arguments(parser) -> None:
    """``--link-latency`` and ``--link-bandwidth``: what the simulator charges each message."""
    parser.add_argument(
        "--link-latency", type=non_negative_float, default=0.0, metavar="US",
        help="a message's fixed cost in microseconds, one way (about half the round trip of a small "
        "message in python -m pipeclock lab 3) (default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--link-bandwidth", type=positive_float, metavar="MIB/S",
        help="the link's bandwidth in MiB/s, as lab 3 prints it for a large message (default: bytes cost "
        "nothing)",
    )  # fmt: skip


def link_from(args: argparse.Namespace):
    """The ``Link`` those two flags describe, in seconds and bytes per second."""
    from pipeclock.observe.simulate import Link

    bandwidth = args.link_bandwidth * 2**20 if args.link_bandwidth else None
    return Link(args.link_latency / 1e6, bandwidth)
