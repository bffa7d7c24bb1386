"""``pipeclock prepare``: documents in, token shards and a dataset.json out, exactly the documents'
tokens with an end-of-text id after each, validation whole documents apart from training."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest

from pipeclock import cli
from pipeclock.data import documents as documents_module
from pipeclock.data.prepare import dtype_for, is_validation, prepare
from pipeclock.data.tokenizer import files_sha256
from tests.token_cases import EOT_TEXT, bpe_tokenizer, documents, split_tokens, write_jsonl


def byte_tokens(texts: list[str]) -> np.ndarray:
    """What ``bytes`` makes of documents: each one's UTF-8 bytes, then 256."""
    ids = [np.append(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), 256) for t in texts]
    return np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)


def held_out(texts: list[str], fraction: float) -> tuple[list[str], list[str]]:
    train = [t for i, t in enumerate(texts) if not is_validation(i, fraction)]
    val = [t for i, t in enumerate(texts) if is_validation(i, fraction)]
    return train, val


def test_bytes_from_txt_folder_jsonl_and_parquet_are_the_documents_and_separators(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = documents(30)
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, text in enumerate(texts[:5]):
        (folder / f"{i:02d}.txt").write_text(text)
    (folder / ".hidden.txt").write_text("never read")
    (folder / "data.bin").write_bytes(b"\0\1\2")  # binary in a folder: skipped
    write_jsonl(tmp_path / "docs.jsonl", texts[5:20])
    pq.write_table(pa.table({"text": texts[20:]}), tmp_path / "docs.parquet")
    inputs = [str(folder), str(tmp_path / "docs.jsonl"), str(tmp_path / "docs.parquet")]
    meta = prepare(inputs, tmp_path / "out", "bytes", validation_fraction=0.3)

    train, val = held_out(texts, 0.3)
    assert train and val, "both splits hold documents"
    assert np.array_equal(split_tokens(tmp_path / "out", "train"), byte_tokens(train))
    assert np.array_equal(split_tokens(tmp_path / "out", "val"), byte_tokens(val))
    assert meta == json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["eot"]) == ("uint16", 257, 256)
    assert meta["splits"]["train"]["documents"] == len(train)
    assert meta["splits"]["val"]["bytes"] == sum(len(t.encode()) for t in val)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "tok", documents(40))


def test_a_bpe_tokenizer_round_trips_and_is_recorded_by_its_files(tmp_path, bpe):
    texts, tokenizer = documents(40), bpe
    meta = prepare([str(write_jsonl(tmp_path / "d.jsonl", texts))], tmp_path / "out", str(tokenizer),
                   validation_fraction=0.2)  # fmt: skip
    from transformers import AutoTokenizer

    decoder = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    train, val = held_out(texts, 0.2)
    for split, texts_in in (("train", train), ("val", val)):
        decoded = decoder.decode(split_tokens(tmp_path / "out", split).tolist())
        assert decoded == "".join(t + EOT_TEXT for t in texts_in)
    assert meta["vocab_size"] == len(decoder) and meta["eot"] == decoder.eos_token_id
    assert meta["tokenizer"]["name"] == type(decoder).__name__
    assert meta["tokenizer"]["sha256"] == files_sha256(tokenizer)
    assert meta["splits"]["train"]["tokens"] < meta["splits"]["train"]["bytes"], "BPE merges bytes"


def test_validation_is_whole_documents_none_of_them_in_training(tmp_path):
    texts = documents(200)
    prepare([str(write_jsonl(tmp_path / "d.jsonl", texts))], tmp_path / "out", validation_fraction=0.1)
    splits = {
        s: bytes(split_tokens(tmp_path / "out", s).astype(np.uint8)).split(b"\0") for s in ("train", "val")
    }
    # 256 as uint8 is 0: each split's bytes cut at the separators are its documents, whole
    train, val = ({d.decode() for d in docs if d} for docs in splits.values())
    assert train | val == set(texts) and not train & val
    assert 5 <= len(val) <= 40


def test_workers_shards_and_pieces_change_nothing_in_the_stream(tmp_path, monkeypatch):
    texts = documents(60)
    big = tmp_path / "big.txt"
    big.write_text("".join(texts))  # one document, read in many pieces below
    inputs = [str(write_jsonl(tmp_path / "d.jsonl", texts)), str(big)]
    prepare(inputs, tmp_path / "one", validation_fraction=0.2)
    monkeypatch.setattr(documents_module, "PIECE_BYTES", 100)
    meta = prepare(inputs, tmp_path / "two", workers=2, validation_fraction=0.2, shard_tokens=500)
    assert len(meta["splits"]["train"]["shards"]) > 3
    assert all(s["tokens"] <= 500 for s in meta["splits"]["train"]["shards"])
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(tmp_path / "one", split), split_tokens(tmp_path / "two", split))


def prepare_command(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(["prepare", *argv])
    return code, out.getvalue(), err.getvalue()


def test_the_command_prints_what_it_wrote(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", documents(50))
    code, out, err = prepare_command(str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "out"),
                                     "--workers", "1", "--validation-fraction", "0.1")  # fmt: skip
    assert code == 0, err
    assert "bytes tokens, vocabulary 257 (uint16), end-of-text id 256" in out
    assert "MB/s" in out and (tmp_path / "out" / "dataset.json").is_file()


def test_a_vocabulary_past_65536_takes_uint32():
    assert [dtype_for(n) for n in (257, 65_536, 65_537, 128_256)] == ["uint16", "uint16", "uint32", "uint32"]


def test_a_tokenizer_without_an_end_of_text_token_is_refused(tmp_path, bpe):
    copy = tmp_path / "no_eos"
    copy.mkdir()
    for path in bpe.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    write_jsonl(tmp_path / "d.jsonl", documents(3))
    code, _, err = prepare_command(str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "out"),
                                   "--tokenizer", str(copy))  # fmt: skip
    assert code == 2 and "it has no end-of-text token (eos_token)" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing field", "no string field 'body'"),
        ("empty input", "no text in"),
        ("tokenizer without files", "no tokenizer files in it"),
        ("no such input", "no such file or folder"),
        ("output not empty", "the folder is not empty"),
        ("parquet without the column", "no column 'body'"),
        ("a line that is not JSON", "not a JSON object"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, expected):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "d.jsonl", documents(3))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "p.parquet")
    argv = {
        "missing field": ["d.jsonl", "--field", "body"],
        "empty input": ["empty.txt"],
        "tokenizer without files": ["d.jsonl", "--tokenizer", "no_tokenizer"],
        "no such input": ["nothing.jsonl"],
        "output not empty": ["d.jsonl", "--output", "full"],
        "parquet without the column": ["p.parquet", "--field", "body"],
        "a line that is not JSON": ["bad.jsonl"],
    }[case]
    argv = [str(tmp_path / a) if not a.startswith("-") and a != "body" else a for a in argv]
    if "--output" not in argv:
        argv += ["--output", str(tmp_path / "out")]
    code, out, err = prepare_command(*argv, "--workers", "1")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("pipeclock prepare: error: ") and expected in err, err
    assert not (tmp_path / "out").exists(), "a refused preparation leaves nothing behind"
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
