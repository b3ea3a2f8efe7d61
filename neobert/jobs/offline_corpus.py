"""The offline-corpus job (`python -m experiments.offline_corpus`): the documentation and docstrings that CPython
and the installed packages ship, written as JSON lines with a `content` column (the corpus itself:
`neobert.data.offline_corpus`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from neobert.data.offline_corpus import write_offline_corpus


def run_offline_corpus(output: str | Path, roots: Sequence[str | Path] | None, max_chars: int, min_words: int,
                       shuffle_seed: int | None) -> dict:
    """Writes the corpus of `roots` (None: this Python's standard library and site-packages) to `output`, kept when
    it exists, and returns {"documents", "characters", "sha256", "path"}."""
    return write_offline_corpus(output, roots, max_chars, min_words, shuffle_seed)
