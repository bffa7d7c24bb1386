"""Documents and a tokenizer to try `prepare` and `train --data` on, made here with nothing downloaded.

    python docs/guide/example_documents.py my-docs.jsonl my-tokenizer

writes every module docstring of this Python's standard library as one document of a .jsonl file (one JSON
object a line, the text under "text", as most corpora come), and trains a byte-level BPE tokenizer of
2,048 tokens on them with the `tokenizers` library that transformers uses, saved as a tokenizer directory
that `AutoTokenizer.from_pretrained` reads. Bring your own documents and tokenizer in their place.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

VOCABULARY = 2048


def module_docstrings() -> list[str]:
    """The standard library's module docstrings of at least 200 characters, in file-name order."""
    documents = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if docstring and len(docstring) >= 200:
            documents.append(docstring)
    return documents


def save_tokenizer(documents: list[str], directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCABULARY, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator(documents, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(str(directory))


def main(jsonl: str, tokenizer: str) -> None:
    documents = module_docstrings()
    with open(jsonl, "w", encoding="utf-8") as out:
        for text in documents:
            out.write(json.dumps({"text": text}) + "\n")
    save_tokenizer(documents, Path(tokenizer))
    print(f"{len(documents)} documents written to {jsonl}; a {VOCABULARY}-token BPE tokenizer to {tokenizer}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python docs/guide/example_documents.py DOCUMENTS.jsonl TOKENIZER_DIR")
    main(sys.argv[1], sys.argv[2])
