"""``train --model hf``: a Hugging Face causal LM, unmodified, on the text corpus.

The model comes from ``--hf-config PATH`` (a ``config.json`` or a directory holding one: random initial
weights from ``--seed``) or ``--hf-model DIR`` (a local ``from_pretrained`` directory: its weights, each
rank reading only its own tensors). Nothing is downloaded. The corpus is read in the tokens of DIR's own
tokenizer when it has one, else as bytes, for which the model's vocabulary must have at least 256 entries.
A token folder (``prepare``'s, or nanoGPT's) is read as its tokens, and the model's vocabulary must
cover the dataset's: checked before the first step.
The loss is HF's ``labels=`` loss (the labels are the inputs, shifted inside the loss); validation is in
bits per byte as for the GPT (nats per token over the validation text's bytes per token).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from pipeclock.data.tokens import is_token_folder
from pipeclock.engine.placement import Placement
from pipeclock.models.text import bigram_bits_per_byte
from pipeclock.parallel.tensor_parallel import read_plan
from pipeclock.training.tasks import LanguageTask


def hf_source(config) -> str:
    """The path the run's model comes from: exactly one of ``--hf-config`` and ``--hf-model``."""
    given = [path for path in (config.hf_config, config.hf_model) if path]
    if len(given) > 1:
        raise ValueError(
            "--hf-config and --hf-model both name the model: give one, --hf-config PATH (random weights) or "
            "--hf-model DIR (its weights)"
        )
    if not given:
        raise ValueError("--model hf needs one of --hf-config PATH (random weights) or --hf-model DIR")
    path = Path(given[0])
    if not path.exists():
        raise ValueError(
            f"{'--hf-config' if config.hf_config else '--hf-model'} {path}: no such file or directory"
        )
    return str(path)


class HFTask(LanguageTask):
    """A Hugging Face causal LM on a byte-level corpus (``--data``, or the standard library's sources)."""

    def __init__(self, config):
        from pipeclock.models import hf
        from pipeclock.models.hf.tokens import Tokens, has_tokenizer

        self.source = hf_source(config)
        self.trusted = config.trust_remote_code
        self.hf_config = hf.prepared_config(hf.config_of(self.source, self.trusted))
        self.layout = hf.layout_of(self.hf_config, self.trusted)
        given = config.hf_model and has_tokenizer(self.source)
        self.tokens = Tokens(self.source) if given else None
        token_data = is_token_folder(config.data)
        self._check_fits(config, token_data)
        super().__init__(config)
        self.bytes = None if token_data else self.corpus  # the bigram baseline reads the text as bytes
        if token_data:
            self._check_dataset_vocabulary()
            self._check_dataset_tokenizer()
            self.tokens = self.tokens or _dataset_tokens(self.corpus)
        elif self.tokens is not None:
            self.corpus = self.corpus.tokenized(self.tokens.encode, self.tokens.name)
            self.corpus.check_fits(config.seq_len)
            self.validation = self.corpus.validation_batches(
                config.batch_size, config.seq_len, max(1, config.eval_batches)
            )
        self.loss_fn = hf.loss(self.hf_config)
        self.validation = [(inputs, inputs) for inputs, _ in self.validation]  # HF's loss shifts them

    def _check_dataset_vocabulary(self) -> None:
        """The model's vocabulary must hold every id of the dataset's (or bound a nanoGPT folder's)."""
        vocabulary, data = self.hf_config.vocab_size, self.corpus
        if data.vocab_size is None:
            data.bound(vocabulary)
        elif data.vocab_size > vocabulary:
            raise ValueError(
                f"--data {data.folder}: its vocabulary of {data.vocab_size:,} ({data.tokenizer}) is larger "
                f"than the model's {vocabulary:,} ({self.source}): give the model a vocab_size of at least "
                f"{data.vocab_size:,}"
            )

    def _check_dataset_tokenizer(self) -> None:
        """A pretrained model (``--hf-model`` with its tokenizer) reads ids in its own tokenizer's words: a
        folder prepared by another tokenizer, or as bytes, would train it on ids that mean other text."""
        from pipeclock.data.tokenizer import files_sha256

        data = self.corpus
        if self.tokens is None or data.tokenizer_sha256 is None:  # no tokenizer here, or nanoGPT's unknown
            return
        if data.tokenizer_sha256 != files_sha256(Path(self.source)):
            prepared = (
                "as bytes" if not data.tokenizer_sha256 else f"by {data.tokenizer} at {data.tokenizer_path}"
            )
            raise ValueError(
                f"--data {data.folder} was prepared {prepared}, not by {self.source}'s own tokenizer: "
                f"its ids would mean other text to this model (prepare --tokenizer {self.source})"
            )

    def _check_fits(self, config, token_data: bool = False) -> None:
        from pipeclock.models.hf import MIN_BYTE_VOCABULARY

        vocabulary = self.hf_config.vocab_size
        if self.tokens is not None and self.tokens.vocab_size > vocabulary and not token_data:
            raise ValueError(
                f"{self.source}: its tokenizer gives {self.tokens.vocab_size} ids, more than the model's "
                f"vocabulary of {vocabulary}"
            )
        if self.tokens is None and vocabulary < MIN_BYTE_VOCABULARY and not token_data:
            raise ValueError(
                f"{self.source}: a vocabulary of {vocabulary} tokens cannot hold the corpus's bytes "
                f"(at least {MIN_BYTE_VOCABULARY} are needed without a tokenizer)"
            )
        positions = getattr(self.hf_config, "max_position_embeddings", None)
        if positions is not None and config.seq_len > positions:
            raise ValueError(f"--seq-len {config.seq_len} is longer than the model's {positions} positions")

    def build(self, rank: int, world: int, placement: Placement, cut=None) -> list[nn.Module]:
        from pipeclock.models import hf

        weights = self.source if self.config.hf_model else None
        chunks = hf.split(
            self.hf_config, rank, world, chunks=len(placement.stages[rank]), placement=placement,
            balance=cut, seed=self.config.seed, weights=weights, trust_remote_code=self.trusted,
        )  # fmt: skip
        return chunks if isinstance(chunks, list) else [chunks]

    def batch(self, step: int, size: int, rows: slice = slice(None)):
        inputs, _ = super().batch(step, size, rows)
        return inputs, inputs

    def tp_plan(self, tp: int, cut: list[range] | None, num_virtual: int) -> dict[str, str]:
        """The plan transformers applies to the model (its config's, or ``--tp-plan``'s in that format)."""
        from pipeclock.models import hf

        given = read_plan(self.config.tp_plan) if self.config.tp_plan else None
        return hf.tp_plan(self.hf_config, tp, given)

    def ep_plan(self, ep: int) -> dict[str, str]:
        """The experts' plan (the config's ``base_model_ep_plan``, or ``--ep-plan``'s in that format)."""
        from pipeclock.models import hf
        from pipeclock.parallel.experts import read_plan as read_ep_plan

        given = read_ep_plan(self.config.ep_plan) if self.config.ep_plan else None
        return hf.ep_plan(self.hf_config, ep, given)

    def baseline_bits_per_byte(self) -> float | None:
        """The bigram byte model on the validation text's (byte, next byte) pairs: the GPT's windows of
        the same corpus, so both tasks print the same figure (the model's own pairs are (inputs,
        inputs), which HF's loss shifts: scored as they are, they would pair each byte with itself).
        None on a token folder, whose bytes are not at hand."""
        if self.bytes is None:
            return None
        windows = self.bytes.validation_batches(
            self.config.batch_size, self.config.seq_len, max(1, self.config.eval_batches)
        )
        return bigram_bits_per_byte(self.bytes, windows)

    def model_name(self) -> str:
        kind = (self.hf_config.architectures or ["HF"])[0]
        return f"{kind} {self.layout.num_layers} layers"

    def run_info(self) -> dict:
        return {
            "model": "HF",
            "hf_config": self.hf_config.to_dict(),
            "seed": self.config.seed,
            "seq_len": self.config.seq_len,
            "corpus_sha256": self.corpus.sha256,
            **({"tokenizer": str(self.tokens.directory)} if self.tokens is not None else {}),
            # the model's own code stays where it was: export and generate read it from there again
            **({"trust_remote_code": str(Path(self.source).resolve())} if self.trusted else {}),
        }


def _dataset_tokens(dataset):
    """The tokenizer directory ``prepare`` read the dataset with, where it still is: a checkpoint names it,
    so that ``generate`` and ``export`` speak the model's tokens; None for bytes or a nanoGPT folder."""
    from pipeclock.models.hf.tokens import Tokens, has_tokenizer

    path = dataset.tokenizer_path
    return Tokens(path) if path and has_tokenizer(path) else None
