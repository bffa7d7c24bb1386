"""``python -m pipeclock prepare INPUT... --output DIR``: documents to token shards for ``train --data``."""

from __future__ import annotations

import argparse
import os
import sys
import time

from pipeclock.cli.arguments import positive_int, probability
from pipeclock.data.documents import InputError
from pipeclock.data.prepare import PrepareError, prepare
from pipeclock.data.tokenizer import TokenizerError

DESCRIPTION = (
    "Tokenize documents into token shards that train --data DIR reads memory-mapped. "
    "Inputs: text files (each file one document), folders of them (hidden and binary files skipped), "
    ".jsonl (one JSON object per line, the document in --field) and .parquet (the --field column; "
    "needs pyarrow). Output: DIR/train_0000.bin ... and DIR/val_0000.bin ..., flat little-endian uint16 "
    "token ids (uint32 when the vocabulary exceeds 65,536), each document followed by the tokenizer's "
    "end-of-text id, and DIR/dataset.json (dtype, vocabulary size, end-of-text id, the tokenizer's name "
    "and SHA-256 of its files, documents, tokens and text bytes per split, each shard's token count). "
    "The 'bytes' tokenizer is UTF-8 bytes (ids 0-255) with 256 as end-of-text: a vocabulary of 257. "
    "The validation split is whole documents, chosen by a hash of each document's index, so it never "
    "overlaps training and does not depend on --workers. Memory stays bounded: documents are streamed "
    "(a large text file in pieces of about 1 MB) and shards written as they grow."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="text, .jsonl or .parquet files, or folders"
    )
    parser.add_argument(
        "--output", required=True, metavar="DIR", help="the folder to write (new or empty; required)"
    )
    parser.add_argument(
        "--tokenizer", default="bytes", metavar="DIR|bytes",
        help="a local Hugging Face tokenizer directory (tokenizer.json or tokenizer_config.json; its "
        "eos_token separates documents; nothing is downloaded), or bytes",
    )  # fmt: skip
    parser.add_argument("--field", default="text", help="the document's field in .jsonl, column in .parquet")
    parser.add_argument(
        "--workers", type=positive_int, default=max(1, min(8, os.cpu_count() or 1)), metavar="N",
        help="processes that tokenize in parallel (default: the CPU count, at most 8)",
    )  # fmt: skip
    parser.add_argument(
        "--validation-fraction", type=probability, default=0.01, metavar="F",
        help="the share of documents held out for validation (whole documents)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        dataset = prepare(
            args.inputs, args.output, args.tokenizer, args.field, args.workers, args.validation_fraction,
            progress=True,
        )  # fmt: skip
    except (InputError, PrepareError, TokenizerError, OSError) as error:
        print(f"pipeclock prepare: error: {error}", file=sys.stderr, flush=True)
        return 2
    seconds = time.perf_counter() - started
    print(_summary(dataset, args.output, seconds))
    return 0


def _summary(dataset: dict, output: str, seconds: float) -> str:
    splits = dataset["splits"]
    text = sum(split["bytes"] for split in splits.values())
    lines = [
        f"prepared {output}: {dataset['tokenizer']['name']} tokens, vocabulary {dataset['vocab_size']:,} "
        f"({dataset['dtype']}), end-of-text id {dataset['eot']}",
    ]
    for name, split in splits.items():
        lines.append(
            f"  {name:5s} {split['documents']:>9,} documents  {split['tokens']:>13,} tokens  "
            f"{split['bytes']:>13,} bytes of text  {len(split['shards'])} shard(s)"
        )
    documents = sum(split["documents"] for split in splits.values())
    if splits["val"]["documents"] == 0:
        cure = (
            "raise --validation-fraction"
            if documents > 1
            else "give it several: a file or a .jsonl line each"
        )
        lines.append(
            f"  no document was held out ({documents:,} in all): train --data needs a validation split "
            f"({cure})"
        )
    lines.append(
        f"  {text / 1e6:.1f} MB of text in {seconds:.1f} s ({text / 1e6 / max(seconds, 1e-9):.1f} MB/s)"
    )
    return "\n".join(lines)
