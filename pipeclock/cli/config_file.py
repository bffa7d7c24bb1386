"""``--config FILE.toml``: a command's flags from a TOML file, the command line overriding them.

Every key is a flag without its dashes (``weight-decay = 0.1``; ``weight_decay`` too); tables only group
keys (``[optimizer]`` then ``lr = 3e-4`` is ``--lr 3e-4``). The file becomes arguments placed before the
command line's, so argparse applies each flag's own checks (the same messages) and the command line wins
(argparse keeps a flag's last value). The known keys are the parser's own options: a flag added to the
command is a key, with no change here. ``resolved_toml`` writes a run's every setting back as TOML, which
``--config`` reads to run the same run again.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Iterator
from pathlib import Path

OPTION = "--config"
RESOLVED_NAME = "config.toml"  # the resolved configuration, beside the checkpoints and in the log folder


class ConfigFileError(ValueError):
    """A config file that cannot be read: one line naming the file and the cause."""


def expand(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the flags of the ``--config`` file it names (if any) in front of it."""
    path = config_path(argv)
    if path is None:
        return argv
    return file_arguments(parser, path) + argv


def config_path(argv: list[str]) -> str | None:
    """The file ``--config`` names in ``argv`` (its last one, as argparse keeps), or None."""
    finder = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    finder.add_argument(OPTION)
    try:
        found, _ = finder.parse_known_args(argv)
    except argparse.ArgumentError:  # no value after --config: the command's own parser says so
        return None
    return found.config


def file_arguments(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The file's keys as command-line arguments, each value already checked by its flag."""
    options = _options(parser)
    words: list[str] = []
    seen: dict[str, str] = {}
    for key, value in _flat(_read(path)):
        action = _action_for(key, options, path)
        name = action.option_strings[-1]
        if name in seen:
            raise ConfigFileError(f"{OPTION} {path}: {key!r} and {seen[name]!r} both set {name}")
        seen[name] = key
        words += _words(action, name, value, key, path)
    _check_values(parser, words, path)
    return words


def _toml():
    """Python's TOML reader (3.11 on), or the ``tomli`` package it came from."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigFileError(f"{OPTION} needs Python 3.11 or later, or the tomli package") from None
    return tomllib


def _read(path: str) -> dict:
    tomllib = _toml()
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigFileError(f"{OPTION} {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigFileError(f"{OPTION} {path}: that is a folder; name a .toml file") from None
    except OSError as error:
        raise ConfigFileError(f"{OPTION} {path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ConfigFileError(f"{OPTION} {path}: not UTF-8 text ({error.reason})") from None
    except tomllib.TOMLDecodeError as error:  # its message ends "(at line L, column C)"
        raise ConfigFileError(f"{OPTION} {path}: not valid TOML: {error}") from None


def _flat(table: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    """Every (key, value) with tables opened: ``[model] layers = 4`` gives ("model.layers", 4)."""
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's long options by name without dashes (``weight-decay``), ``--config`` and help left out."""
    options = {}
    for action in parser._actions:  # argparse has no public list of a parser's options
        if isinstance(action, argparse._HelpAction) or OPTION in action.option_strings:
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                options[option[2:]] = action
    return options


def _action_for(key: str, options: dict[str, argparse.Action], path: str) -> argparse.Action:
    name = key.rsplit(".", 1)[-1]
    flag = name.replace("_", "-")
    if flag in options:
        return options[flag]
    if flag == OPTION[2:]:
        raise ConfigFileError(f"{OPTION} {path}: {key!r}: a config file cannot name another one")
    nearest = difflib.get_close_matches(flag, list(options), n=1, cutoff=0.0)
    hint = f"; the nearest is {nearest[0]!r} ({OPTION[:2]}{nearest[0]})" if nearest else ""
    raise ConfigFileError(f"{OPTION} {path}: unknown key {key!r}{hint}")


def _words(action: argparse.Action, name: str, value, key: str, path: str) -> list[str]:
    """``value`` as the words the command line would give: a switch's true is the bare flag."""
    if action.nargs == 0:  # store_true and its kind: a switch
        if not isinstance(value, bool):
            raise ConfigFileError(f"{OPTION} {path}: {key} takes true or false, got {_shown(value)}")
        return [name] if value == action.const else []
    if action.nargs == argparse.OPTIONAL and isinstance(value, bool):  # --resume: bare, or with a value
        return [name] if value else []
    if action.nargs in (argparse.ONE_OR_MORE, argparse.ZERO_OR_MORE) or isinstance(action.nargs, int):
        return [name, *(_text(item) for item in _listed(value))]
    if isinstance(action, argparse._AppendAction):
        return [f"{name}={_text(item)}" for item in _listed(value)]
    if isinstance(value, list):  # a flag of one value takes a list as its comma-separated form
        return [f"{name}={','.join(_text(item) for item in value)}"]
    return [f"{name}={_text(value)}"]  # "=": a value starting with "-" stays a value


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def _text(value) -> str:
    """A TOML value as typed on a command line: floats in full, booleans as TOML writes them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else _text(value)


def _check_values(parser: argparse.ArgumentParser, words: list[str], path: str) -> None:
    """Each value through its flag's own check, so a bad one is named as the file's, in the flag's words."""
    exits = parser.exit_on_error
    parser.exit_on_error = False
    try:
        parser.parse_known_args(words)
    except argparse.ArgumentError as error:
        raise ConfigFileError(f"{OPTION} {path}: {error}") from None
    finally:
        parser.exit_on_error = exits


# --- the resolved configuration, written back ----------------------------------------------------------


def resolved_toml(parser: argparse.ArgumentParser, args: argparse.Namespace, filled: dict) -> str:
    """Every flag's value for this run as TOML (``--config`` reads it back to the same run).

    A flag left unset takes ``filled``'s value for its name (the defaults a run resolves itself, such as
    a model's step count); a flag unset in both is left out (TOML has no "none").
    """
    lines = ["# the resolved configuration of a pipeclock train run; run it again with --config FILE"]
    for name, action in _options(parser).items():
        if name != action.option_strings[-1][2:]:
            continue  # an alias: its flag's own name says it
        value = getattr(args, action.dest, None)
        if value is None:
            value = filled.get(action.dest)
        if value is None:
            continue
        lines.append(f"{name} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def toml_value(value) -> str:
    """One TOML value: a boolean, a number, a string, or an array of them (a tuple too)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return ("-" if value < 0 else "") + ("inf" if math.isinf(value) else "nan")
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return _toml_string(str(value))


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def write_resolved(text: str, folders: list[str]) -> list[Path]:
    """``text`` as ``config.toml`` in each folder (created if need be); the files written."""
    written = []
    for folder in dict.fromkeys(str(Path(f)) for f in folders):
        path = Path(folder) / RESOLVED_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".toml.partial")
        partial.write_text(text)
        partial.replace(path)
        written.append(path)
    return written
