"""A Hugging Face config that transformers' own checks refuse, as one line (no torch imported: the planner
reads configs without it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def config_refusals(path: Path) -> Iterator[None]:
    """A config transformers refuses when it is read (heads that do not divide the width) as one
    ValueError naming the file and the check's reason, not the validator's traceback."""
    from huggingface_hub.errors import StrictDataclassClassValidationError

    try:
        yield
    except StrictDataclassClassValidationError as error:
        reason = str(error.__cause__ or error).strip().splitlines()[-1].strip()
        raise ValueError(f"{path}: transformers refuses this config: {reason}") from None
