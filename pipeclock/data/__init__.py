"""Token datasets: ``prepare`` turns documents into token shards, ``train --data DIR`` reads them lazily.

- ``documents``: text files, folders, ``.jsonl`` and ``.parquet`` as a stream of documents.
- ``tokenizer``: the ``bytes`` tokenizer or a local Hugging Face tokenizer directory, with its
  end-of-text id (the separator between documents).
- ``prepare``: the streaming, multi-process writer of shards and ``dataset.json``.
- ``tokens``: a prepared folder (or nanoGPT's ``train.bin``/``val.bin``) memory-mapped; batch k from
  (seed, k) alone.

May import: models.
"""
