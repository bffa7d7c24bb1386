"""Outputs checked by writing, a held checkpoint folder, and the other commands' bad input: one line each.

Every case runs the command as a user types it (in this process, or under ``unshare`` for the mounts)
and must print exactly one line on stderr, no traceback, with the exit code the page says. The lines are
the second table of docs/errors.md, which ``test_the_errors_page_shows_these_lines`` compares with what
the code printed (``PIPECLOCK_WRITE_ERRORS=1`` writes it instead). Paths are shown as ``DIR``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeclock.checkpoints import folder_lock
from pipeclock.cli.arguments import check_output
from pipeclock.cli.dispatch import main
from pipeclock.engine.memory import ActivationMeter

PAGE = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
TABLE_START, TABLE_END = "<!-- errors table: tests/test_user_errors.py -->", "<!-- end errors table -->"
TINY = ["--hidden", "8", "--layers", "2", "--steps", "1", "--batch-size", "2"]


def _cases(tmp: Path) -> list[tuple[str, list[str]]]:
    """(the wrong usage, the command line) for each in-process case; files are made in ``tmp``."""
    (tmp / "a_file").write_text("")
    (tmp / "a_folder").mkdir()
    run, held = str(tmp / "run"), str(tmp / "held")
    (tmp / "typo.toml").write_text("wieght-decay = 0.1\n")
    (tmp / "doc.txt").write_text("a document of a few words\n")
    (tmp / "empty").mkdir()
    tokens = str(tmp / "tokens")
    assert main(["prepare", str(tmp / "doc.txt"), "--output", tokens, "--tokenizer", "bytes"]) == 0
    return [
        ("`--checkpoint-dir` under `/proc` (root may write anywhere else)",
         ["train", *TINY, "--checkpoint-dir", "/proc/pipeclock-run"]),
        ("`--png` under `/proc`", ["train", *TINY, "--png", "/proc/pipeclock/timeline.png"]),
        ("`--checkpoint-dir` that another live run holds", ["train", *TINY, "--checkpoint-dir", held]),
        ("`export` to an existing folder", ["export", run, str(tmp / "a_folder")]),
        ("`export` to an existing file (`--overwrite` replaces it)", ["export", run, str(tmp / "a_file")]),
        ("`export` to a path that cannot be written", ["export", run, "/proc/model.pt"]),
        ("a flag typed wrong", ["train", "--stepps", "3"]),
        ("`--weight-decay` with `--optimizer adam`", ["train", *TINY, "--weight-decay", "0.1"]),
        ("`--compile` with the MLP", ["train", *TINY, "--compile"]),
        ("`--lr-schedule wsd` without `--decay-steps`", ["train", *TINY, "--lr-schedule", "wsd"]),
        ("`--warmup-steps` longer than the run", ["train", *TINY, "--warmup-steps", "5"]),
        ("a `--config` file with a misspelt key", ["train", *TINY, "--config", str(tmp / "typo.toml")]),
        ("`--wandb` without the wandb package", ["train", *TINY, "--wandb", "project"]),
        ("`--data` a folder with no text", ["train", *TINY, "--model", "gpt", "--data", str(tmp / "empty")]),
        ("`--token-dtype` other than the prepared folder's",
         ["train", *TINY, "--model", "gpt", "--data", tokens, "--token-dtype", "uint32"]),
        ("`prepare` into a folder that is not empty", ["prepare", str(tmp / "doc.txt"), "--output", tokens]),
        ("`prepare` of an input that does not exist",
         ["prepare", str(tmp / "absent.txt"), "--output", str(tmp / "out")]),
        ("`prepare --validation-fraction 0` (train needs a validation split)",
         ["prepare", str(tmp / "doc.txt"), "--output", str(tmp / "out"), "--validation-fraction", "0"]),
    ]  # fmt: skip


def _shown(line: str, tmp: Path) -> str:
    line = line.replace(str(tmp), "DIR")
    return re.sub(r"\(pid \d+ on host \S+\)", "(pid PID on host HOST)", line)


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> list[tuple[str, list[str], int, str]]:
    """Each case: its usage, command, exit code and the whole of what it printed on stderr."""
    tmp = tmp_path_factory.mktemp("user-errors")
    held = folder_lock.lock(tmp / "held")  # this process is the other run: a second open is refused
    found = []
    try:
        for usage, argv in _cases(tmp):
            before = sorted(tmp.rglob("*"))
            stderr = _stderr_of(argv)
            assert sorted(tmp.rglob("*")) == before, usage  # the probes left nothing behind
            found.append((usage, argv, *stderr))
    finally:
        folder_lock.release(held)
    found += _on_mounts(tmp)
    return [(usage, argv, code, _shown(err, tmp)) for usage, argv, code, err in found]


def _stderr_of(argv: list[str]) -> tuple[int, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        code = main(argv)
    return code, err.getvalue()


# --- read-only and full file systems: mounted in a mount namespace of their own --------------------------

_MOUNTS = """
set -e
mkdir -p {tmp}/readonly {tmp}/full
mount --bind -o ro {tmp}/readonly {tmp}/readonly
mount -t tmpfs -o size=16k tmpfs {tmp}/full
dd if=/dev/zero of={tmp}/full/filler bs=4k count=8 2>/dev/null || true
exec {python} -c '{code}' "$0"
"""
_CHECKS = (
    "import json, sys; from pipeclock.cli.arguments import check_output\n"
    "out = []\n"
    "for path, option, folder in json.loads(sys.argv[1]):\n"
    "    try: check_output(path, option, folder); out.append(None)\n"
    '    except ValueError as e: out.append(f"pipeclock train: error: {e}")\n'
    "print(json.dumps(out))"
)


def _on_mounts(tmp: Path) -> list[tuple[str, list[str], int, str]]:
    """The mount cases (the train command's own check, without the train), where mounting is allowed."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("mounting a read-only bind and a full tmpfs needs root and unshare")
    asked = [
        ("`--trace` in a read-only mount", str(tmp / "readonly" / "trace.json"), "--trace", False),
        ("`--checkpoint-dir` on a full disk", str(tmp / "full" / "checkpoints"), "--checkpoint-dir", True),
    ]
    script = _MOUNTS.format(tmp=tmp, python=sys.executable, code=_CHECKS)
    argument = json.dumps([[path, option, folder] for _, path, option, folder in asked])
    ran = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, argument], capture_output=True, text=True, timeout=60
    )
    if ran.returncode != 0 and "mount" in ran.stderr:
        pytest.skip(f"this machine does not allow the mounts: {ran.stderr.strip()}")
    lines = json.loads(ran.stdout)
    return [
        (usage, ["train", option, path], 2, f"{line}\n")
        for (usage, path, option, _), line in zip(asked, lines, strict=True)
    ]


# --- the properties ---------------------------------------------------------------------------------------


def test_each_is_refused_in_one_line_with_exit_code_2_and_no_traceback(printed):
    for usage, _, code, stderr in printed:
        assert code == 2, (usage, stderr)
        assert stderr.count("\n") == 1 and "Traceback" not in stderr, (usage, stderr)
        assert re.match(r"pipeclock (train|export|generate|prepare): error: ", stderr), (usage, stderr)


def test_each_names_the_path_or_flag_at_fault(printed):
    wanted = {
        "/proc": "/proc",
        "another live run": "is in use by another run (pid PID on host HOST)",
        "existing folder": "that is a folder; name a file",
        "existing file": "exists; pass --overwrite",
        "read-only": "Read-only file system",
        "full disk": "No space left on device",
        "typed wrong": "unrecognized arguments: --stepps 3 (did you mean --steps?)",
        "--weight-decay": "--optimizer adamw",
        "--compile": "the MLP has none",
        "--decay-steps": "--decay-steps N",
        "--warmup-steps": "--warmup-steps 5",
        "misspelt": "the nearest is 'weight-decay'",
        "wandb": "pip install wandb",
        "no text": "no readable text file",
        "--token-dtype": "dataset.json's dtype uint16",
        "not empty": "the folder is not empty",
        "does not exist": "no such file or folder",
        "--validation-fraction 0": "train --data needs a validation split: give a fraction above 0",
    }
    for usage, _, _, stderr in printed:
        for key, words in wanted.items():
            if key in usage:
                assert words in stderr, (usage, stderr)


def test_a_folder_the_permission_bits_forbid_is_refused_exactly_when_writing_there_fails(tmp_path):
    """As root the bits forbid nothing, and the check agrees with a real write; as anyone else both fail."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        try:
            check_output(folder / "losses.json", "--losses")
            refused = False
        except ValueError:
            refused = True
        try:
            (folder / "losses.json").write_text("{}")
            written = True
        except OSError:
            written = False
        assert refused != written
    finally:
        folder.chmod(0o700)


def test_the_activation_meter_leaves_a_stages_python_values_to_the_engines_own_message():
    """A stage returning ``(x, 3)``, ``(x, None)`` or a cache object: the meter counts the tensors only."""
    meter = ActivationMeter([torch.nn.Linear(4, 4)])
    x = torch.randn(4, 4)
    with meter.measuring("mb0", [x, 3, None, object()]):
        pass
    meter.hold("mb0")
    assert meter.live == x.nbytes


def _table_rows(printed) -> list[str]:
    rows = ["| wrong usage | exit code | what it prints on stderr (the whole of it) |", "|---|---|---|"]
    for usage, _, code, stderr in printed:
        rows.append(f"| {usage} | {code} | {stderr.strip().replace('|', '&#124;')} |")
    return rows


def test_the_errors_page_shows_these_lines(printed):
    text = PAGE.read_text()
    before, rest = text.split(TABLE_START + "\n", 1)
    _, after = rest.split(TABLE_END, 1)
    wanted = before + TABLE_START + "\n" + "\n".join(_table_rows(printed)) + "\n" + TABLE_END + after
    if os.environ.get("PIPECLOCK_WRITE_ERRORS") == "1":
        PAGE.write_text(wanted)
    assert text == wanted, "docs/errors.md: run PIPECLOCK_WRITE_ERRORS=1 pytest tests/test_user_errors.py"


def test_a_labs_wrong_argument_is_its_own_error_before_torchrun_starts(capfd):
    """The lab's parser reads its arguments in the launcher: no rank, and no torchrun report, is started."""
    assert main(["lab", "3", "--bogus", "mine.py"]) == 2
    out, err = capfd.readouterr()
    assert out == ""  # no "$ torchrun ..." line: nothing was launched
    assert err.strip().splitlines()[-1] == "03_ping_pong.py: error: unrecognized arguments: --bogus mine.py"
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "norm",
    [torch.nn.BatchNorm1d(4), torch.nn.LazyBatchNorm1d(), torch.nn.SyncBatchNorm(4)],
    ids=["BatchNorm1d", "LazyBatchNorm1d", "SyncBatchNorm"],
)
def test_every_kind_of_batch_norm_in_a_stage_is_warned_about(norm):
    from pipeclock import schedule

    with pytest.warns(UserWarning, match="holds a BatchNorm"):
        schedule.Pipeline(
            torch.nn.Sequential(torch.nn.Linear(4, 4), norm), "1f1b", 2, torch.nn.functional.mse_loss
        )


def test_a_layer_norm_in_a_stage_is_not_warned_about(recwarn):
    from pipeclock import schedule

    schedule.Pipeline(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)),
        "1f1b",
        2,
        torch.nn.functional.mse_loss,
    )
    assert not [w for w in recwarn if "BatchNorm" in str(w.message)]
