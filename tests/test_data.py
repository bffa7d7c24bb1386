"""``train --data DIR`` on tokens: a prepared folder or nanoGPT's bins, memory-mapped; batch k is windows
of the token stream from (seed, k) alone, the same on every layout and after a resume; bad folders and
tokens out of range are one line each."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from pipeclock.data.prepare import prepare
from pipeclock.data.tokens import TokenDataError, TokenDataset, TokenStream
from tests.distributed import command, printed, run_ok, start_ranks
from tests.token_cases import bpe_tokenizer, documents, split_tokens, write_jsonl

SEQ = 32


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Bytes of 300 documents, in shards of 1,000 tokens so that windows cross from shard to shard."""
    folder = tmp_path_factory.mktemp("data")
    write_jsonl(folder / "docs.jsonl", documents(300))
    prepare([str(folder / "docs.jsonl")], folder / "tokens", validation_fraction=0.1, shard_tokens=1000)
    return folder / "tokens"


def contains_window(stream: np.ndarray, window: np.ndarray) -> bool:
    views = np.lib.stride_tricks.sliding_window_view(stream, window.size)
    return bool((views == window).all(axis=1).any())


def test_batch_k_is_windows_of_the_stream_from_seed_and_k_alone(prepared):
    data, stream = TokenDataset(prepared), split_tokens(prepared, "train")
    assert len(data.train.maps) > 10, "many shards"
    inputs, targets = data.batch(5, 8, SEQ, seed=3)
    assert inputs.shape == (8, SEQ) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for row in range(8):
        assert contains_window(stream, torch.cat([inputs[row], targets[row, -1:]]).numpy())
    again = TokenDataset(prepared).batch(5, 8, SEQ, seed=3)
    assert torch.equal(again[0], inputs), "a fresh open (a resumed run) sees the same batch k"
    assert not torch.equal(data.batch(6, 8, SEQ, seed=3)[0], inputs)
    assert not torch.equal(data.batch(5, 8, SEQ, seed=4)[0], inputs)


def test_a_window_across_shards_is_the_stream_across_them(prepared):
    data, stream = TokenDataset(prepared), split_tokens(prepared, "train")
    assert np.array_equal(data.train.window(990, 40), stream[990:1030])
    assert np.array_equal(data.train.window(0, data.train.numel()), stream)


def test_each_replica_reads_its_own_rows_and_they_make_the_global_batch(prepared, monkeypatch):
    data = TokenDataset(prepared)
    whole = data.batch(2, 8, SEQ, seed=0)
    read = []
    original = TokenStream.window
    monkeypatch.setattr(TokenStream, "window", lambda self, s, n: read.append(s) or original(self, s, n))
    parts = [data.batch(2, 8, SEQ, seed=0, rows=slice(a, a + 2)) for a in (0, 2, 4, 6)]
    assert len(read) == 8, "each replica read its two windows, and no other"
    for whole_part, pieces in zip(whole, zip(*parts, strict=True), strict=True):
        assert torch.equal(torch.cat(pieces), whole_part)


def test_validation_windows_are_fixed_disjoint_and_in_the_validation_split(prepared):
    data, val = TokenDataset(prepared), split_tokens(prepared, "val")
    batches = data.validation_batches(4, SEQ, 3)
    assert len(batches) == 3 and all(inputs.shape == (4, SEQ) for inputs, _ in batches)
    windows = [window for inputs, targets in batches for window in torch.cat([inputs, targets[:, -1:]], 1)]
    assert all(contains_window(val, w.numpy()) for w in windows)
    again = data.validation_batches(4, SEQ, 3)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True)
    )


def test_a_prepared_folder_of_uint32_reads_the_same_stream(prepared, tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir()
    meta = json.loads((prepared / "dataset.json").read_text())
    for path in prepared.glob("*.bin"):
        np.fromfile(path, dtype="<u2").astype("<u4").tofile(wide / path.name)
    (wide / "dataset.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    narrow, data = TokenDataset(prepared), TokenDataset(wide)
    assert data.dtype == "uint32" and torch.equal(data.batch(3, 8, SEQ)[0], narrow.batch(3, 8, SEQ)[0])


def nanogpt_folder(folder, dtype: str, vocabulary: int):
    folder.mkdir()
    generator = np.random.default_rng(0)
    for name, size in (("train.bin", 5000), ("val.bin", 500)):
        generator.integers(0, vocabulary, size).astype(dtype).tofile(folder / name)
    return folder


def test_nanogpt_bins_are_read_as_they_are(tmp_path):
    folder = nanogpt_folder(tmp_path / "small", "uint16", 65)
    data = TokenDataset(folder)
    assert data.vocab_size is None and data.train.numel() == 5000
    assert np.array_equal(data.train.window(100, 50), np.fromfile(folder / "train.bin", np.uint16)[100:150])
    with open(folder / "meta.pkl", "wb") as handle:
        pickle.dump({"vocab_size": 65, "itos": {0: "a"}}, handle)
    assert TokenDataset(folder).vocab_size == 65
    wide = nanogpt_folder(tmp_path / "wide", "uint32", 100_000)
    data = TokenDataset(wide, "uint32")
    assert data.train.window(7, 3).tolist() == np.fromfile(wide / "train.bin", np.uint32)[7:10].tolist()
    (wide / "val.bin").write_bytes((wide / "val.bin").read_bytes()[:-2])
    with pytest.raises(TokenDataError, match="not a whole number of uint32 tokens"):
        TokenDataset(wide, "uint32")


def test_a_meta_pkl_that_would_run_code_is_refused(tmp_path):
    folder = nanogpt_folder(tmp_path / "n", "uint16", 65)
    with open(folder / "meta.pkl", "wb") as handle:
        pickle.dump({"vocab_size": 65, "evil": print}, handle)
    with pytest.raises(TokenDataError, match="no plain vocab_size"):
        TokenDataset(folder)


def test_a_token_out_of_range_names_the_shard_and_the_offset(prepared, tmp_path):
    copy = tmp_path / "tokens"
    copy.mkdir()
    for path in prepared.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    shard = np.memmap(copy / "train_0002.bin", dtype="<u2", mode="r+")
    shard[17] = 300
    shard.flush()
    data = TokenDataset(copy)
    with pytest.raises(
        TokenDataError, match=r"train_0002.bin: token 300 at offset 17 is outside the vocabulary of 257"
    ):
        data.train.window(1990, 100)


# The train command on a token folder: each case a command line, its exit code and what rank 0 printed.
GPT = ["train", "--model", "gpt", "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
       "--batch-size", "4", "--eval-every", "3", "--eval-batches", "1"]  # fmt: skip


def run_commands(rank: int, world: int, lines: list[list[str]]) -> list[tuple[int, str, str]]:
    """Command lines one after another on this rank (a one-rank launch: each run's group ends before
    the next begins)."""
    return [(printed.code, printed.out, printed.err) for printed in (command(rank, world, a) for a in lines)]


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    """pp 2 for 6 steps; dp 2 for 3, saved; one process for 6 straight, then the dp run resumed to 6."""
    tmp, data = tmp_path_factory.mktemp("runs"), ["--data", str(prepared)]
    pp2 = start_ranks(
        command, 2, [*GPT, *data, "--steps", "6", "--losses", str(tmp / "pp2.json")], deadline=300
    )
    saved = ["--checkpoint-dir", str(tmp / "ckpt"), "--losses", str(tmp / "dp2.json")]
    dp2 = start_ranks(command, 2, [*GPT, *data, "--steps", "3", "--dp", "2", *saved], deadline=300)
    out = printed(pp2)
    printed(dp2)
    one = run_ok(run_commands, 1, [
        [*GPT, *data, "--steps", "6", "--losses", str(tmp / "one.json")],
        [*GPT, *data, "--steps", "6", "--checkpoint-dir", str(tmp / "ckpt"), "--resume",
         "--losses", str(tmp / "resumed.json")],
    ], deadline=300)[0]  # fmt: skip
    assert [code for code, _, _ in one] == [0, 0], one
    names = ("pp2", "dp2", "one", "resumed")
    return out, {name: json.loads((tmp / f"{name}.json").read_text())["losses"] for name in names}


@pytest.fixture(scope="module")
def refusals(prepared, tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Each bad folder's train run, on one process."""
    bad = bad_folders(prepared, tmp_path_factory.mktemp("bad"))
    found = run_ok(run_commands, 1, [[*GPT, *argv, "--steps", "1"] for argv in bad.values()], deadline=300)[0]
    return dict(zip(bad, found, strict=True))


def bad_folders(prepared, tmp) -> dict[str, list[str]]:
    short, wide, outside, hf = tmp / "short", tmp / "wide", tmp / "outside", tmp / "hf.json"
    for folder in (short, outside):
        folder.mkdir()
        for path in prepared.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
    (short / "train_0001.bin").write_bytes((short / "train_0001.bin").read_bytes()[:-6])
    for path in outside.glob("train_*.bin"):
        np.full(path.stat().st_size // 2, 400, dtype="<u2").tofile(path)
    prepare([str(write_jsonl(tmp / "one.jsonl", documents(5)))], wide, validation_fraction=0.001)  # none
    from tests.hf_cases import llama_config

    config = llama_config(layers=2)
    config.vocab_size = 200
    hf.write_text(config.to_json_string())
    return {
        "cut short": ["--data", str(short)],
        "dtype": ["--data", str(prepared), "--token-dtype", "uint32"],
        "out of range": ["--data", str(outside)],
        "no validation": ["--data", str(wide)],
        "hf vocabulary": ["--data", str(prepared), "--model", "hf", "--hf-config", str(hf)],
    }


@pytest.mark.long
def test_every_layout_and_a_resume_follow_the_one_process_curve(runs):
    _, losses = runs
    want = losses["one"]
    assert len(want) == 6 and len(losses["dp2"]) == 3 and len(losses["resumed"]) == 3
    for name, start in (("pp2", 0), ("dp2", 0), ("resumed", 3)):
        gaps = [abs(a - b) / b for a, b in zip(losses[name], want[start:], strict=False)]
        assert max(gaps) <= 1e-5, (name, gaps)


@pytest.mark.long
def test_validation_is_in_nats_per_token_and_bits_per_byte_of_the_text(runs):
    out, _ = runs
    assert "validation after 6 steps:" in out and "nats/token" in out and "bits/byte" in out
    assert "vocabulary 257, uint16" in out and "bigram" not in out


@pytest.mark.parametrize(
    "case, expected",
    [
        ("cut short", "train_0001.bin: 1,994 bytes, cut short: dataset.json says 1,000 tokens of uint16"),
        ("dtype", "--token-dtype uint32 does not match"),
        ("out of range", ".bin: token 400 at offset"),
        ("no validation", "its validation split has 0 tokens"),
        ("hf vocabulary", "its vocabulary of 257 (bytes) is larger than the model's 200"),
    ],
)
def test_a_bad_token_folder_is_one_line_and_exit_2(refusals, case, expected):
    code, _, err = refusals[case]
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err


def test_a_gpt_trained_on_another_tokenizers_ids_is_not_generated_as_bytes(tmp_path):
    """Its ids are not bytes: generate refuses it in one line rather than print another alphabet."""
    texts = documents(60)
    tokenizer = bpe_tokenizer(tmp_path / "tokenizer", texts)
    prepare([str(write_jsonl(tmp_path / "docs.jsonl", texts))], tmp_path / "bpe", tokenizer=str(tokenizer),
            validation_fraction=0.1)  # fmt: skip
    saved = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    (trained, generated) = run_ok(run_commands, 1, [
        [*GPT, "--data", str(tmp_path / "bpe"), "--steps", "1", *saved],
        ["generate", str(tmp_path / "ckpt"), "--prompt", "x", "--tokens", "2"],
    ], deadline=300)[0]  # fmt: skip
    assert trained[0] == 0, trained
    code, _, err = generated
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "this GPT was trained on" in err and "generate writes a GPT's text as bytes" in err
