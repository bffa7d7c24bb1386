"""``train --config FILE.toml``: every flag a key, the command line winning, each mistake one line.

The file is read as the command reads it (``dispatch.build_parser``), in this process: no run starts.
The known keys are the parser's own flags, so each case holds for a flag added later too.
"""

from __future__ import annotations

import argparse
import io
import shlex
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from pipeclock.cli import config_file, dispatch
from pipeclock.cli.arguments import Parser
from pipeclock.cli.commands import train

CONFIGS = Path(__file__).resolve().parents[1] / "docs" / "configs"


def parsed(*argv: str) -> argparse.Namespace:
    return dispatch.build_parser(["train"]).parse_args(["train", *argv])


def refusal(*argv: str) -> tuple[int, str]:
    """The exit code and what ``pipeclock train ARGV`` printed on stderr."""
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        code = dispatch.main(["train", *argv])
    return code, err.getvalue()


def toml(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def train_parser() -> Parser:
    parser = Parser(prog="pipeclock train")
    train.add_arguments(parser)
    return parser


def test_a_key_is_the_flag_without_its_dashes_and_underscores_work_too(tmp_path):
    text = 'model = "gpt"\nbatch-size = 4\nseq_len = 32\ndata_parallel = "ddp"\n'
    args = parsed("--config", toml(tmp_path, text))
    assert (args.model, args.batch_size, args.seq_len, args.data_parallel) == ("gpt", 4, 32, "ddp")


def test_tables_only_group_keys(tmp_path):
    text = "[model]\nlayers = 3\ndim = 64\n[run.optimizer]\nlr = 0.01\n[run]\nsteps = 9\n"
    args = parsed("--config", toml(tmp_path, text))
    assert (args.layers, args.dim, args.lr, args.steps) == (3, 64, 0.01, 9)


def test_the_command_line_wins_wherever_it_names_the_file(tmp_path):
    path = toml(tmp_path, "steps = 5\nlr = 0.5\nhidden = 16\n")
    for argv in (["--config", path, "--steps", "7"], ["--steps", "7", "--config", path]):
        args = parsed(*argv)
        assert (args.steps, args.lr, args.hidden) == (7, 0.5, 16)


def test_switches_are_true_or_false_and_resume_takes_a_path_too(tmp_path):
    assert parsed("--config", toml(tmp_path, "trust-remote-code = true\n")).trust_remote_code is True
    assert parsed("--config", toml(tmp_path, "trust-remote-code = false\n")).trust_remote_code is False
    assert parsed("--config", toml(tmp_path, "resume = true\n")).resume is True
    assert parsed("--config", toml(tmp_path, 'resume = "runs/a"\n')).resume == "runs/a"
    assert parsed("--config", toml(tmp_path, "resume = false\n")).resume is False


def test_a_value_that_looks_like_a_flag_stays_a_value(tmp_path):
    assert parsed("--config", toml(tmp_path, 'data = "-odd-name.txt"\n')).data == "-odd-name.txt"


def test_an_unknown_key_is_named_with_the_nearest_flag(tmp_path):
    code, err = refusal("--config", toml(tmp_path, "[run]\nstpes = 5\n"))
    assert code == 2
    assert err == (
        f"pipeclock train: error: --config {tmp_path}/run.toml: unknown key 'run.stpes'; the nearest is "
        "'steps' (--steps)\n"
    )


def test_a_syntax_error_names_its_line(tmp_path):
    code, err = refusal("--config", toml(tmp_path, "steps = 5\n\nlr = = 3\n"))
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"pipeclock train: error: --config {tmp_path}/run.toml: not valid TOML: ")
    assert "line 3" in err


@pytest.mark.parametrize(
    "key, value, flag",
    [("steps", "0", "--steps 0"), ("lr", "-1.0", "--lr -1.0"), ("schedule", '"fast"', "--schedule fast"),
     ("dropout", "1.5", "--dropout 1.5"), ("seed", '"x"', "--seed x")],
)  # fmt: skip
def test_a_bad_value_gets_the_flags_own_message_naming_the_file(tmp_path, key, value, flag):
    _, on_the_line = refusal(*shlex.split(flag))
    code, from_file = refusal("--config", toml(tmp_path, f"{key} = {value}\n"))
    assert code == 2 and len(from_file.splitlines()) == 1
    assert from_file == on_the_line.replace("error: ", f"error: --config {tmp_path}/run.toml: ", 1)


@pytest.mark.parametrize(
    "text, says",
    [("steps = 1\n[run]\nsteps = 2\n", "'run.steps' and 'steps' both set --steps"),
     ("batch_size = 1\nbatch-size = 2\n", "'batch-size' and 'batch_size' both set --batch-size"),
     ('trust-remote-code = "yes"\n', "trust-remote-code takes true or false, got 'yes'"),
     ('config = "other.toml"\n', "'config': a config file cannot name another one")],
)  # fmt: skip
def test_other_mistakes_in_a_file_are_one_line_each(tmp_path, text, says):
    code, err = refusal("--config", toml(tmp_path, text))
    assert code == 2
    assert err == f"pipeclock train: error: --config {tmp_path}/run.toml: {says}\n"


def test_a_missing_file_is_one_line(tmp_path):
    code, err = refusal("--config", str(tmp_path / "nope.toml"))
    assert (code, err) == (2, f"pipeclock train: error: --config {tmp_path}/nope.toml: no such file\n")


def test_flags_set_away_from_their_defaults_round_trip_through_the_resolved_file(tmp_path):
    argv = shlex.split(
        "--model hf --hf-config c.json --hf-model m --trust-remote-code --schedule zb-h1 --balance time "
        "--microbatches 3 --schedule-csv s.csv --chunks 2 --hidden 9 --layers 5 --dim 24 --heads 3 "
        "--seq-len 17 --dropout 0.125 --data 'my \"corpus\".txt' --eval-every 7 --eval-batches 2 "
        "--batch-size 6 --steps 11 --lr 1e-7 --seed 4 --timeout 3.5 --dp 2 --tp 2 --tp-plan p.json "
        "--tp-timed-steps 1 --data-parallel ddp --clip-grad-norm 0.1 --recompute full --dtype bf16 "
        "--trace t.json --png t.png --link-latency 2 --link-bandwidth 100 --checkpoint-dir ck "
        "--checkpoint-every 4 --resume r --keep-last 2 --losses l.json --log-dir logs --log-every 3 "
        "--wandb proj"
    )
    given = parsed(*argv)
    text = config_file.resolved_toml(train_parser(), given, {})
    again = parsed("--config", toml(tmp_path, text))
    assert vars(again) == {**vars(given), "config": str(tmp_path / "run.toml")}


def test_every_flag_is_a_key_and_its_default_round_trips(tmp_path):
    """Whatever flags the command has (a flag added later included), its resolved file reads back."""
    given = parsed()
    text = config_file.resolved_toml(train_parser(), given, {})
    flags = [a for a in train_parser()._actions if a.option_strings and a.dest not in ("help", "config")]
    written = [a for a in flags if getattr(given, a.dest) is not None]
    assert len(text.splitlines()) == 1 + len(written)
    again = parsed("--config", toml(tmp_path, text))
    assert vars(again) == {**vars(given), "config": str(tmp_path / "run.toml")}


def test_the_resolved_file_fills_what_the_run_resolved_itself(tmp_path):
    given = parsed("--model", "gpt")
    text = config_file.resolved_toml(train_parser(), given, {"steps": 600, "lr": 3e-3})
    assert "steps = 600\n" in text and "lr = 0.003\n" in text and 'model = "gpt"\n' in text
    assert "\nconfig" not in text and "help" not in text


def test_strings_are_written_as_toml_reads_them(tmp_path):
    odd = 'a "quoted" \\ path\twith\x7fcontrol'
    text = config_file.resolved_toml(train_parser(), parsed("--data", odd), {})
    assert parsed("--config", toml(tmp_path, text)).data == odd


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_each_ready_file_in_the_docs_reads_as_a_run(path):
    args = parsed("--config", str(path))
    assert args.steps and args.log_dir
    made_by_prepare = "prepare" in path.read_text()  # data a walk-through makes first (my-data/)
    for name in ("hf_config",) if made_by_prepare else ("hf_config", "data"):
        value = getattr(args, name)
        assert value is None or (CONFIGS.parents[1] / value).exists(), value
