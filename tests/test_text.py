"""text: byte tokens, a reproducible offline corpus, deterministic batches, and an honest bigram baseline."""

from __future__ import annotations

import math
import re
import sysconfig
from pathlib import Path

import pytest
import torch

from pipeclock.models.text import (
    DEFAULT_CORPUS_BYTES,
    ByteTokenizer,
    CorpusError,
    TextCorpus,
    bigram_bits_per_byte,
    bits_per_byte,
)

SPLIT_CORPUS = b"a" * 900 + b"b" * 100  # train is all "a", validation all "b"


def test_the_tokenizer_round_trips_text_including_non_ascii():
    tokenizer = ByteTokenizer()
    text = "héllo, wörld: 東京 🚀\n"
    ids = tokenizer.encode(text)
    assert tokenizer.vocab_size == 256
    assert ids.dtype == torch.int64 and ids.tolist() == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode("")) == ""


def test_decoding_a_cut_character_replaces_it_instead_of_failing():
    ids = ByteTokenizer().encode("é")[:1]
    assert ByteTokenizer().decode(ids) == "\ufffd"


def test_a_file_corpus_holds_the_files_bytes(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(b"it was a dark and stormy night\n" * 10)
    corpus = TextCorpus.from_path(path)
    assert corpus.data.dtype == torch.uint8
    assert bytes(corpus.data.tolist()) == path.read_bytes()
    assert corpus.num_bytes == 310 and str(path) in corpus.description
    assert corpus.summary() == f"corpus: {corpus.description}, 310 bytes, sha256 {corpus.sha256[:12]}"


def test_a_folder_corpus_concatenates_text_files_sorted_skipping_binary_and_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes(b"two ")
    (tmp_path / "a.txt").write_bytes(b"one ")
    (tmp_path / "c.txt").write_bytes(b"three")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\0\0\0")
    (tmp_path / ".hidden").write_bytes(b"secret")
    (tmp_path / ".git" / "config").write_bytes(b"secret")
    corpus = TextCorpus.from_path(str(tmp_path))
    assert bytes(corpus.data.tolist()) == b"one two three"
    assert corpus.files == ("a.txt", "b/two.txt", "c.txt")
    assert "(3 files)" in corpus.description


def test_the_default_corpus_is_the_stdlib_deterministic_and_within_budget():
    first, second = TextCorpus.default(), TextCorpus.default()
    assert first.sha256 == second.sha256 and len(first.sha256) == 64
    assert 0 < first.num_bytes <= DEFAULT_CORPUS_BYTES
    assert f"({len(first.files)} files)" in first.description and "standard library" in first.description
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert list(first.files) == sorted(first.files)
    assert first.num_bytes == sum((stdlib / name).stat().st_size for name in first.files)


def test_the_default_corpus_takes_at_least_one_file_even_over_budget():
    corpus = TextCorpus.default(budget=1)
    assert len(corpus.files) == 1 and corpus.num_bytes > 1


def test_the_validation_split_is_the_last_fraction_of_the_bytes():
    corpus = TextCorpus(SPLIT_CORPUS, "crafted")
    assert corpus.train.numel() == 900 and corpus.validation.numel() == 100
    assert set(corpus.train.tolist()) == {ord("a")} and set(corpus.validation.tolist()) == {ord("b")}


def test_a_batch_depends_only_on_seed_and_step():
    corpus = TextCorpus(bytes(range(256)) * 40, "ramp")
    inputs, targets = corpus.batch(step=7, size=8, seq_len=16, seed=1)
    again_inputs, again_targets = corpus.batch(step=7, size=8, seq_len=16, seed=1)
    assert torch.equal(inputs, again_inputs) and torch.equal(targets, again_targets)
    assert not torch.equal(inputs, corpus.batch(step=8, size=8, seq_len=16, seed=1)[0])
    assert not torch.equal(inputs, corpus.batch(step=7, size=8, seq_len=16, seed=2)[0])


def test_targets_are_the_inputs_shifted_by_one_byte():
    corpus = TextCorpus(bytes(range(256)) * 40, "ramp")
    inputs, targets = corpus.batch(step=0, size=8, seq_len=16)
    assert inputs.shape == targets.shape == (8, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets, (inputs + 1) % 256)  # the ramp's next byte


def test_training_windows_come_from_the_train_split_only():
    corpus = TextCorpus(SPLIT_CORPUS, "crafted")
    for step in range(50):
        inputs, targets = corpus.batch(step, size=16, seq_len=32)
        assert (inputs == ord("a")).all() and (targets == ord("a")).all()


def test_validation_batches_are_fixed_evenly_spread_and_non_overlapping():
    corpus = TextCorpus(bytes(256) + bytes(range(256)), "ramp", validation_fraction=0.5)
    batches = corpus.validation_batches(size=2, seq_len=15, max_batches=3)
    assert len(batches) == 3 and all(inputs.shape == (2, 15) for inputs, _ in batches)
    again = corpus.validation_batches(size=2, seq_len=15, max_batches=3)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True)
    )
    inputs = torch.cat([inputs for inputs, _ in batches])
    starts = inputs[:, 0].tolist()
    assert torch.equal(inputs, inputs[:, :1] + torch.arange(15))  # each window is contiguous validation
    assert starts == [0, 32, 80, 128, 160, 208]  # 16 slots of 16 bytes, 6 spread over them


def test_validation_batches_contain_only_validation_bytes():
    corpus = TextCorpus(SPLIT_CORPUS, "crafted")
    batches = corpus.validation_batches(size=2, seq_len=9, max_batches=100)
    assert len(batches) == 5  # 100 bytes hold 10 windows of 10 bytes
    for inputs, targets in batches:
        assert (inputs == ord("b")).all() and (targets == ord("b")).all()


def test_a_small_validation_split_still_gives_one_batch_of_the_windows_that_fit():
    corpus = TextCorpus(SPLIT_CORPUS, "crafted")
    batches = corpus.validation_batches(size=8, seq_len=30, max_batches=4)
    assert len(batches) == 1 and batches[0][0].shape == (3, 30)


def test_the_bigram_baseline_is_near_zero_on_a_strict_repetition():
    corpus = TextCorpus(b"abc" * 3000, "abc")
    batches = corpus.validation_batches(size=8, seq_len=32, max_batches=4)
    assert bigram_bits_per_byte(corpus, batches) < 1.0


def test_the_bigram_baseline_is_near_eight_bits_on_uniform_random_bytes():
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (1_000_000,), dtype=torch.uint8, generator=generator)
    corpus = TextCorpus(bytes(noise.tolist()), "noise")
    batches = corpus.validation_batches(size=16, seq_len=256, max_batches=8)
    assert abs(bigram_bits_per_byte(corpus, batches) - 8.0) < 0.2


def test_the_bigram_baseline_matches_counting_by_hand():
    corpus = TextCorpus(b"abab" + b"ab", "tiny", validation_fraction=0.5)  # train "aba", pairs ab, ba
    inputs, targets = torch.tensor([[ord("a")]]), torch.tensor([[ord("b")]])
    expected = -math.log2((1 + 1) / (1 + 256))
    assert bigram_bits_per_byte(corpus, [(inputs, targets)]) == pytest.approx(expected)


def test_bits_per_byte_converts_nats():
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)


def test_a_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(CorpusError, match=f"{re.escape(str(missing))} does not exist"):
        TextCorpus.from_path(missing)


def test_a_folder_without_text_files_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match=f"{re.escape(str(tmp_path))} has no readable text file"):
        TextCorpus.from_path(tmp_path)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    with pytest.raises(CorpusError, match=f"{re.escape(str(tmp_path))} has no readable text file"):
        TextCorpus.from_path(tmp_path)


def test_an_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(CorpusError, match=re.escape(f"{tmp_path} (1 file) is empty")):
        TextCorpus.from_path(tmp_path)
    with pytest.raises(CorpusError, match=r"empty\.txt is empty"):
        TextCorpus.from_path(tmp_path / "empty.txt")


def test_a_corpus_shorter_than_one_sequence_fails_before_any_batch(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 1000)  # validation split: 100 bytes
    corpus = TextCorpus.from_path(path)
    corpus.check_fits(99)
    message = f"{path} (1,000 bytes) is shorter than one sequence: its validation split has 100 bytes"
    with pytest.raises(CorpusError, match=re.escape(message)):
        corpus.check_fits(100)
    with pytest.raises(CorpusError, match="shorter than one sequence"):
        corpus.batch(0, size=1, seq_len=100)
    with pytest.raises(CorpusError, match="shorter than one sequence"):
        corpus.validation_batches(size=1, seq_len=100, max_batches=1)
