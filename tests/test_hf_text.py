"""``train --model hf`` on text: the bigram baseline it prints beside its validation, and a model
directory's own tokenizer (the corpus in its tokens, a prepared folder in its words, generate decoding
with it), with one clear line for a folder or a tokenizer that does not fit the model."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_cases import llama_config, one_line_error

# --- what train --model hf prints -------------------------------------------------------------------


def bigram_line(args: list[str], capsys) -> str:
    from pipeclock.cli.dispatch import main

    assert main(["train", *args]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "bigram byte model" in line]
    assert len(lines) == 1
    return lines[0].split(": ")[-1]


def test_the_bigram_baseline_of_an_hf_run_scores_each_byte_against_the_next_as_the_gpts(tmp_path, capsys):
    """The figure ``train --model hf`` prints beside its validation is the bigram byte model's bits per
    byte on the validation text's (byte, next byte) pairs: computed here from counts of the training
    split's pairs, and the same as ``train --model gpt`` prints on the same corpus."""
    from pipeclock.models.text import TextCorpus

    text = Path(json.__file__).read_text()
    (tmp_path / "corpus.txt").write_text(text)
    llama_config(layers=2).save_pretrained(str(tmp_path / "llama"))
    common = ["--data", str(tmp_path / "corpus.txt"), "--steps", "1", "--batch-size", "4", "--seq-len", "16",
              "--eval-batches", "3", "--microbatches", "2"]  # fmt: skip
    hf_figure = bigram_line(["--model", "hf", "--hf-config", str(tmp_path / "llama"), *common], capsys)
    gpt = ["--model", "gpt", "--dim", "16", "--layers", "2", "--heads", "2"]
    gpt_figure = bigram_line([*gpt, *common], capsys)

    corpus = TextCorpus.from_path(tmp_path / "corpus.txt")
    train = corpus.train.tolist()
    counts = torch.ones(256, 256, dtype=torch.float64)  # add-one smoothing
    for previous, following in itertools.pairwise(train):
        counts[previous, following] += 1
    bits = []
    for inputs, targets in corpus.validation_batches(4, 16, 3):
        assert torch.equal(targets[:, :-1], inputs[:, 1:]), "each target is the byte after its input"
        for previous, following in zip(inputs.flatten().tolist(), targets.flatten().tolist(), strict=True):
            bits.append(-math.log2(counts[previous, following] / counts[previous].sum()))
    assert hf_figure == gpt_figure == f"{sum(bits) / len(bits):.3f} bits/byte"


# --- a model's own tokenizer ---------------------------------------------------------------------------


def test_a_model_directorys_tokenizer_reads_the_corpus_and_generate_decodes_with_it(tmp_path, capsys):
    """--hf-model DIR with a tokenizer in DIR: the corpus is its tokens, the checkpoint names it, export
    copies it, and generate (greedy) continues a prompt as the exported model and tokenizer do."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeclock.cli.dispatch import main
    from pipeclock.training.hf_task import HFTask
    from pipeclock.training.loop import TrainConfig
    from tests.hf_cases import model_with_tokenizer

    text = Path(json.__file__).read_text()
    (tmp_path / "corpus.txt").write_text(text)
    model_with_tokenizer(tmp_path / "model", text)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "model"), local_files_only=True)
    flags = dict(model="hf", hf_model=str(tmp_path / "model"), data=str(tmp_path / "corpus.txt"), seq_len=16)
    task = HFTask(TrainConfig(**flags, batch_size=4))
    train_text = text.encode()[: task.bytes.train.numel()].decode("utf-8", errors="replace")
    assert task.corpus.train.tolist() == tokenizer.encode(train_text, add_special_tokens=False)
    assert task.batch(0, 4)[0].max() >= 256  # tokens beyond the bytes' ids

    args = ["--model", "hf", "--hf-model", str(tmp_path / "model"), "--data", str(tmp_path / "corpus.txt"),
            "--seq-len", "16", "--steps", "2", "--batch-size", "4", "--microbatches", "2",
            "--checkpoint-dir", str(tmp_path / "run"), "--eval-batches", "1"]  # fmt: skip
    assert main(["train", *args]) == 0
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def f", "--tokens", "6",
                 "--temperature", "0"]) == 0  # fmt: skip
    generated = capsys.readouterr().out  # the text and a newline: strip() would also eat a generated \f
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    ids = exported.encode("def f", add_special_tokens=False)
    with torch.no_grad():
        for _ in range(6):
            ids.append(model(torch.tensor([ids])).logits[0, -1].argmax().item())
    assert generated == exported.decode(ids) + "\n"


def test_a_pretrained_model_trains_only_on_a_folder_its_own_tokenizer_prepared(tmp_path):
    """--hf-model DIR reads ids in DIR's tokenizer's words: a folder prepared as bytes, or by another
    tokenizer, is refused in one line naming the cure; one prepared by DIR's tokenizer is taken."""
    import shutil

    from pipeclock.cli.dispatch import main
    from pipeclock.training.hf_task import HFTask
    from pipeclock.training.loop import TrainConfig
    from tests.hf_cases import model_with_tokenizer
    from tests.token_cases import bpe_tokenizer, documents, write_jsonl

    texts = documents()
    jsonl = write_jsonl(tmp_path / "docs.jsonl", texts)
    other = bpe_tokenizer(tmp_path / "other", texts)
    model_with_tokenizer(tmp_path / "model", "".join(texts))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the model's tokenizer becomes ``other``'s
        shutil.copy(other / name, tmp_path / "model" / name)
    other_again = bpe_tokenizer(tmp_path / "other_again", texts[::-1], vocab_size=300)
    for folder, tokenizer in (("bytes", "bytes"), ("own", tmp_path / "model"), ("another", other_again)):
        argv = ["prepare", str(jsonl), "--output", str(tmp_path / folder), "--tokenizer", str(tokenizer)]
        assert main([*argv, "--validation-fraction", "0.2"]) == 0
    flags = dict(model="hf", hf_model=str(tmp_path / "model"), seq_len=8, batch_size=4)
    assert HFTask(TrainConfig(**flags, data=str(tmp_path / "own"))).corpus.vocab_size <= 320
    for folder, prepared in (("bytes", "as bytes"), ("another", f"at {other_again}")):
        config = TrainConfig(**flags, data=str(tmp_path / folder))
        message = one_line_error(lambda config=config: HFTask(config))
        assert "was prepared" in message and prepared in message, message
        assert f"prepare --tokenizer {tmp_path / 'model'}" in message, message


def test_a_tokenizer_with_more_ids_than_the_model_is_one_clear_line(tmp_path):
    from pipeclock.training.hf_task import HFTask
    from pipeclock.training.loop import TrainConfig
    from tests.hf_cases import model_with_tokenizer

    model_with_tokenizer(tmp_path, "a few words to learn merges from")
    config = json.loads((tmp_path / "config.json").read_text())
    ids = config["vocab_size"]  # the tokenizer's, all of them
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": ids - 1}))
    message = one_line_error(lambda: HFTask(TrainConfig(model="hf", hf_model=str(tmp_path))))
    assert f"its tokenizer gives {ids} ids, more than the model's vocabulary of {ids - 1}" in message
