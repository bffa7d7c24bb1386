"""A local ``from_pretrained`` directory's own tokenizer, when it has one: text to token ids and back.

A model trained with a tokenizer only makes sense with it, so ``train --model hf --hf-model DIR`` uses
the one in DIR (read from local files only: nothing is downloaded). Without one, the model reads bytes,
which needs a vocabulary of at least 256 entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# Any of these beside a config means the directory holds a tokenizer (fast, sentencepiece or BPE files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: str | Path) -> bool:
    return Path(directory).is_dir() and any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


class Tokens:
    """The tokenizer of a directory, as text in, ids out: no special tokens added, so a corpus encoded in
    pieces is the same ids as encoded whole, and a prompt continues as the training text did."""

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer
        from transformers.utils import logging

        logging.disable_progress_bar()
        self.directory = Path(directory).resolve()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except (OSError, ValueError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"{self.directory}: its tokenizer cannot be read: {first}") from None

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can give, added tokens included."""
        return len(self.tokenizer)

    @property
    def name(self) -> str:
        return type(self.tokenizer).__name__

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def save(self, directory: str | Path) -> None:
        """Beside an exported model, so ``AutoTokenizer.from_pretrained(directory)`` finds it too."""
        self.tokenizer.save_pretrained(str(directory))
