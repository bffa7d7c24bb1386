"""What a newcomer tries on a fresh clone, and what each unusual input must give: the work, or one line.

Each case here was once a traceback, a hang or a silent wrong answer. The multi-process ones share a
launch where they can; the in-process ones run ``python -m pipeclock`` as ``main([...])``.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from pipeclock.cli.dispatch import main
from pipeclock.generation.decode_program import decode_instructions, decode_program

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ["--model", "gpt", "--dim", "16", "--layers", "1", "--heads", "2", "--seq-len", "16",
            "--steps", "1", "--batch-size", "2", "--microbatches", "1", "--eval-batches", "1"]  # fmt: skip


def run_command(*argv: str) -> tuple[int, str, str]:
    """``python -m pipeclock ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def one_line(code: int, stderr: str, prefix: str) -> str:
    """The one error line a refusal printed (exit 2, no traceback), without its prefix."""
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, (code, stderr)
    assert stderr.startswith(prefix), stderr
    return stderr[len(prefix) :].strip()


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    """A one-step GPT checkpoint, small enough to generate from at once."""
    directory = tmp_path_factory.mktemp("gpt") / "run"
    code, _, err = run_command("train", *TINY_GPT, "--checkpoint-dir", str(directory))
    assert code == 0, err
    return directory


# --- generate ------------------------------------------------------------------------------------------


def test_the_decode_program_made_as_it_is_walked_is_the_lowered_one():
    for p in range(1, 5):
        for groups in range(1, 4):
            for tokens in range(8):
                lowered = decode_program(p, groups, tokens)
                for rank in range(p):
                    made = list(decode_instructions(p, groups, tokens, rank))
                    assert made == lowered[rank], (p, groups, tokens, rank)
                    assert [i.action for i in made] == [i.action for i in lowered[rank]]


def test_a_billion_tokens_stream_from_the_first_byte_and_ctrl_c_ends_with_one_line(gpt_run):
    """The decode program is made as it is walked: the first bytes come at once, whatever --tokens asks."""
    command = [sys.executable, "-m", "pipeclock", "generate", str(gpt_run), "--prompt", "def ",
               "--tokens", "1000000000", "--temperature", "0"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        printed, deadline = b"", time.monotonic() + 120
        while len(printed) < len("def ") + 64 and time.monotonic() < deadline:
            if select.select([process.stdout], [], [], 1.0)[0]:
                printed += os.read(process.stdout.fileno(), 4096)
        assert len(printed) >= len("def ") + 64, f"only {printed!r} in 120 s"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    assert stderr.decode().splitlines()[-1] == "rank 0: interrupted", stderr.decode()
    assert "Traceback" not in stderr.decode()


def test_a_tokenizer_that_no_longer_fits_the_model_is_one_line(tmp_path):
    """Training refuses a tokenizer with ids beyond the vocabulary; so do generate and export, when the
    tokenizer a run was trained with was replaced by such a one since."""
    from tests.hf_cases import model_with_tokenizer

    text = Path(json.__file__).read_text()
    (tmp_path / "corpus.txt").write_text(text)
    model_with_tokenizer(tmp_path / "model", text, vocab_size=300)
    code, _, err = run_command(
        "train", "--model", "hf", "--hf-model", str(tmp_path / "model"),
        "--data", str(tmp_path / "corpus.txt"), "--seq-len", "8", "--steps", "1", "--batch-size", "2",
        "--microbatches", "1", "--eval-batches", "1", "--checkpoint-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 0, err
    vocabulary = json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    model_with_tokenizer(tmp_path / "other", text, vocab_size=400)  # a larger tokenizer in its place
    for name in os.listdir(tmp_path / "other"):
        if name.startswith(("tokenizer", "special_tokens")):
            os.replace(tmp_path / "other" / name, tmp_path / "model" / name)
    wanted = f"now gives 400 ids, more than the model's vocabulary of {vocabulary}"
    generated = run_command("generate", str(tmp_path / "run"), "--prompt", "def f", "--tokens", "4")
    assert wanted in one_line(*generated[::2], "pipeclock generate: error: ")
    exported = run_command("export", str(tmp_path / "run"), "--hf", str(tmp_path / "out"))
    assert wanted in one_line(*exported[::2], "pipeclock export: error: ")


# --- train: refusals that name what is wrong --------------------------------------------------------------


MLP = ["--layers", "2", "--steps", "1", "--batch-size", "2"]


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory) -> Path:
    """A one-step ShardedMLP checkpoint, 2 x 8."""
    directory = tmp_path_factory.mktemp("mlp") / "run"
    code, _, err = run_command("train", *MLP, "--hidden", "8", "--checkpoint-dir", str(directory))
    assert code == 0, err
    return directory


def test_a_resume_refused_for_another_size_names_the_field(mlp_run, tmp_path):
    code, _, err = run_command("train", *MLP, "--hidden", "12", "--checkpoint-dir", str(tmp_path), "--resume",
                               str(mlp_run))  # fmt: skip
    assert one_line(code, err, "pipeclock train: error: ").endswith(
        "holds a ShardedMLP 2 x 8, not 2 x 12 (--hidden 8, not 12)"
    )


def test_refusals_exit_with_2_as_the_readme_says(mlp_run, tmp_path):
    """A checkpoint --resume names that is not there or damaged, and a lab that does not exist, are
    refused as any value that cannot work is (export and generate already said 2 for the same)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(mlp_run, damaged)
    for shard in damaged.rglob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    into = ["--checkpoint-dir", str(tmp_path / "new")]
    for resume, said in ((tmp_path / "nowhere", "it does not exist"), (damaged, "is damaged")):
        code, _, err = run_command("train", *MLP, "--hidden", "8", *into, "--resume", str(resume))
        assert said in one_line(code, err, "pipeclock train: error: ")
    code, _, err = run_command("lab", "99")
    assert "no lab 99" in one_line(code, err, "pipeclock lab: error: ")


@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory) -> Path:
    """Tiny configs: a GPT-2 stored in bfloat16, and a BERT (an encoder)."""
    from transformers import BertConfig, GPT2Config

    root = tmp_path_factory.mktemp("configs")
    small = dict(vocab_size=300, bos_token_id=0, eos_token_id=0)
    GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=32, dtype="bfloat16", **small).to_json_file(
        root / "gpt2.json"
    )
    BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, **small
    ).to_json_file(root / "bert.json")
    return root


HF_TINY = ["--model", "hf", "--steps", "1", "--seq-len", "8", "--batch-size", "2", "--microbatches", "1",
           "--eval-batches", "1"]  # fmt: skip


def test_an_encoder_config_is_refused_as_not_a_causal_lm(hf_configs):
    code, _, err = run_command("train", *HF_TINY, "--hf-config", str(hf_configs / "bert.json"))
    message = one_line(code, err, "pipeclock train: error: ")
    assert "BertConfig describes an encoder model (bert): encoder models are not causal LMs" in message


def test_hf_config_and_hf_model_together_are_refused_as_two_sources(hf_configs):
    code, _, err = run_command(
        "train", *HF_TINY, "--hf-config", str(hf_configs), "--hf-model", str(hf_configs)
    )
    assert "--hf-config and --hf-model both name the model: give one" in one_line(
        code, err, "pipeclock train: error: "
    )


@pytest.fixture(scope="module")
def gpt2_run(hf_configs) -> tuple[Path, str]:
    """A one-step GPT-2 checkpoint (its config stored in bfloat16), and what training printed."""
    directory = hf_configs / "run"
    code, _, err = run_command("train", *HF_TINY, "--hf-config", str(hf_configs / "gpt2.json"),
                               "--checkpoint-dir", str(directory))  # fmt: skip
    assert code == 0, err
    return directory, err


def test_training_bfloat16_weights_as_float32_is_said_once_in_one_line(gpt2_run):
    _, err = gpt2_run
    said = [line for line in err.splitlines() if "master weights" in line]
    assert said == [
        "pipeclock train: warning: GPT2Config: weights stored as bfloat16 are trained as float32 master "
        "weights (--dtype bf16 computes in bfloat16 over them)"
    ], err
    assert "Warning:" not in err and ".py:" not in err, err


# --- export -------------------------------------------------------------------------------------------


def test_an_exported_model_folder_follows_the_umask_like_any_other_file(gpt2_run, tmp_path):
    mask = os.umask(0o027)  # a mask that differs from what safetensors writes (0600) and from the usual
    try:
        assert run_command("export", str(gpt2_run[0]), "--hf", str(tmp_path / "out"))[0] == 0
    finally:
        os.umask(mask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes


_FULL_DISK = """
set -e
mkdir -p {full}
mount -t tmpfs -o size=64k tmpfs {full}
{python} -m pipeclock export {run} {full}/model.pt || echo "exit $?" >&2
ls -A {full}
"""


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_truncated_file(tmp_path):
    """The state_dict (132 KB) does not fit the 64 KB disk: no partial file stays, and the line says so."""
    if os.geteuid() != 0 or subprocess.run(["which", "unshare"], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root and unshare")
    flags = ["--hidden", "128", "--layers", "2", "--steps", "1", "--batch-size", "2"]
    assert run_command("train", *flags, "--checkpoint-dir", str(tmp_path / "run"))[0] == 0
    script = _FULL_DISK.format(full=tmp_path / "full", python=sys.executable, run=tmp_path / "run")
    ran = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)  # fmt: skip
    if ran.returncode != 0 and "mount" in ran.stderr:
        pytest.skip(f"this machine does not allow the mount: {ran.stderr.strip()}")
    assert ran.stdout == "", "the folder must be left empty: " + ran.stdout
    error, code = ran.stderr.splitlines()
    assert code == "exit 1" and "Traceback" not in ran.stderr, ran.stderr
    assert error == (
        f"pipeclock export: error: writing {tmp_path}/full/model.pt failed: its disk is full (it had 65.5 KB "
        "free, the model needs 132 KB); nothing was written"
    )


# --- under torchrun -------------------------------------------------------------------------------------


def test_the_static_rendezvous_is_warned_about_with_what_fixes_it(tmp_path):
    """torchrun without --standalone keeps one store for every restart whatever
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE says (the restart recipe of docs/guide/checkpoints.md once did so): the
    warning names the fix."""
    from tests.distributed import free_port
    from tests.jobs import Launch

    static = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    job = Launch(tmp_path / "static", 1, ["train", *MLP, "--hidden", "8"], restarts=1, rendezvous=static)
    job.result()
    warned = [
        line for line in job.err.read_text().splitlines() if line.startswith("pipeclock train: warning")
    ]
    assert len(warned) == 1 and "static rendezvous" in warned[0], job.err.read_text()
    assert "launch with --standalone on one machine" in warned[0]


def test_each_way_torchrun_keeps_its_store_gets_its_own_advice():
    from pipeclock.cli.commands.train import restart_warning

    launched = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    shared = restart_warning({**launched, "TORCHELASTIC_RUN_ID": "9f0c"})  # --standalone, variable unset
    assert shared and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared and "static" not in shared
    assert "static rendezvous" in restart_warning({**launched, "TORCHELASTIC_RUN_ID": "none"})
    assert restart_warning({**launched, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # the fix
    assert restart_warning({**launched, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # no restart


@pytest.mark.long  # 21 s, most of it the rendezvous timeout it waits out
def test_a_process_group_that_cannot_form_in_time_is_one_line_per_rank(tmp_path):
    """``--timeout 0.01``: the store's wait or gloo's own connections time out, by chance; either way each
    rank says so in one line, and no traceback (a rank still starting when torchrun stops it says that
    instead). Two jobs at once, for both ways to come up."""
    from tests.jobs import Launch

    flags = ["train", *MLP, "--hidden", "8", "--timeout", "0.01"]
    jobs = [Launch(tmp_path / f"job{n}", 2, flags, rank_logs=tmp_path / f"ranks{n}") for n in range(2)]
    for job in jobs:
        job.proc.wait(timeout=240)
    for n in range(2):
        logs = sorted(tmp_path.glob(f"ranks{n}/*/attempt_0/*/stderr.log"))
        texts = [log.read_text() for log in logs]
        assert len(texts) == 2 and all("Traceback" not in text for text in texts), texts
        said = [[line for line in text.splitlines() if ONE_LINE.match(line)] for text in texts]
        assert all(len(lines) == 1 for lines in said), texts
        assert any(lines[0].startswith("pipeclock train: error: rank ") for lines in said), texts


ONE_LINE = re.compile(r"^(pipeclock train: (error|stopped|interrupted)|rank \d+: (stopped|interrupted))")


BOTH_SIGNALS_AT_ONCE = """
import os, signal, time
from pipeclock.cli.interrupts import run_as_script

def main():
    both = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, both)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the terminal
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun passing it on, before the first is handled
    signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
    time.sleep(60)

run_as_script(main)
"""


def test_ctrl_c_and_torchrun_s_sigterm_at_once_end_a_lab_with_its_one_line():
    """A lab's rank gets Ctrl-C's SIGINT and torchrun's SIGTERM together, both pending when the first is
    handled: Python must not then say 'OSError: Signal 15 ignored due to race condition'."""
    ran = subprocess.run([sys.executable, "-c", BOTH_SIGNALS_AT_ONCE], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)  # fmt: skip
    assert (ran.returncode, ran.stderr) == (130, "rank 0: interrupted\n")


def test_more_ranks_than_gpus_under_nccl_is_one_line_naming_both_numbers_and_the_way_out():
    """Two ranks on a machine with one GPU: refused before nccl starts (run on a GPU, this was a
    traceback from comms.init). The check takes the GPU count, so it runs here without one."""
    from pipeclock import comms

    with pytest.raises(ValueError) as caught:
        comms.check_gpus(rank=1, local_ranks=2, gpus=1)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("rank 1: 2 ranks on this machine")
    assert "but 1 GPU(s) visible" in message and "start at most 1 rank(s) per machine" in message
    assert "CUDA_VISIBLE_DEVICES=" in message
    comms.check_gpus(rank=0, local_ranks=2, gpus=2)  # a GPU each: nothing to say
