"""What ``prepare`` tokenizes with: ``bytes``, or a local Hugging Face tokenizer directory.

``bytes`` is UTF-8 bytes (ids 0-255) plus one end-of-text id, 256, that separates documents: a
vocabulary of 257, which a text byte can never collide with. A directory is read with transformers'
``AutoTokenizer`` from local files only (nothing is downloaded); its end-of-text id is its ``eos_token``.
A tokenizer's identity, recorded in ``dataset.json``, is its name and a SHA-256 over its files, so a
dataset can say exactly what produced it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

# Any of these in a directory means it holds a tokenizer (as ``models.hf.tokens`` reads it, whose package
# would import torch, which ``prepare`` does without).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTES = "bytes"
BYTES_EOT = 256
# The files that make up a tokenizer (not a model's weights beside it): hashed into its identity.
IDENTITY_FILES = (
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: no tokenizer files, unreadable, or without an end-of-text token."""


class PrepareTokenizer:
    """Texts in, token id lists out (no special tokens added), with ``eot`` to put between documents."""

    def __init__(self, spec: str):
        self.spec = spec
        if spec == BYTES:
            self.name, self.vocab_size, self.eot, self.sha256 = BYTES, BYTES_EOT + 1, BYTES_EOT, ""
            self._tokenizer = None
            return
        directory = Path(spec)
        if not directory.is_dir():
            raise TokenizerError(
                f"--tokenizer {spec}: not a directory (give a tokenizer directory or 'bytes')"
            )
        if not any((directory / name).is_file() for name in TOKENIZER_FILES):
            raise TokenizerError(
                f"--tokenizer {spec}: no tokenizer files in it (looked for {', '.join(TOKENIZER_FILES)})"
            )
        self._tokenizer = _load(directory)
        self.name = type(self._tokenizer).__name__
        self.vocab_size = len(self._tokenizer)
        self.eot = _end_of_text(self._tokenizer, spec)
        self.sha256 = files_sha256(directory)

    def encode(self, texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
        """Each text's ids (no special tokens added) and its length in UTF-8 bytes."""
        encoded = [text.encode("utf-8") for text in texts]
        if self._tokenizer is None:
            ids = [np.frombuffer(data, dtype=np.uint8) for data in encoded]
        else:
            found = self._tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            ids = [np.asarray(one.ids, dtype=np.uint32) for one in found]
        return ids, [len(data) for data in encoded]

    def identity(self) -> dict:
        """What ``dataset.json`` records of the tokenizer."""
        path = self.spec if self.spec == BYTES else str(Path(self.spec).resolve())
        return {"name": self.name, "path": path, "sha256": self.sha256, "eot": self.eot}


def files_sha256(directory: Path) -> str:
    """SHA-256 over the tokenizer files in ``directory``, each as its name then its bytes, by name."""
    digest = hashlib.sha256()
    for name in sorted(IDENTITY_FILES):
        path = directory / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _load(directory: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TokenizerError(f"--tokenizer {directory}: cannot be read: {first}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TokenizerError(
            f"--tokenizer {directory}: {type(tokenizer).__name__} is not a fast tokenizer (the tokenizers "
            "library's, saved as tokenizer.json), which prepare needs"
        )
    return tokenizer


def _end_of_text(tokenizer, spec: str) -> int:
    """The eos token's id; a tokenizer without one cannot separate documents, so it is refused."""
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise TokenizerError(
        f"--tokenizer {spec}: it has no end-of-text token (eos_token) to separate documents with"
    )
