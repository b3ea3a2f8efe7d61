"""The tokenizer job (`python -m experiments.train_tokenizer`): a WordPiece or byte-level BPE tokenizer trained on a
pretraining config's data and saved where `data.tokenizer` loads it (the training itself:
`neobert.data.tokenizer.train_tokenizer`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from neobert.data.tokenizer import (MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, TOKENIZER_KINDS, check_tokenizer_request,
                                    train_tokenizer)
from neobert.jobs.pretrain import load_pretrain_config

# The kinds and vocabulary bounds the command line offers and names in its help.
__all__ = ["MAX_VOCAB_SIZE", "MIN_VOCAB_SIZE", "TOKENIZER_KINDS", "run_train_tokenizer"]


def run_train_tokenizer(output: str | Path, config: str | None, overrides: Sequence[str], kind: str, vocab_size: int,
                        max_docs: int, overwrite: bool, keys: tuple[str, str]) -> Path:
    """Trains on the data of the pretraining config `config` (with its key=value `overrides`) and returns the
    tokenizer directory; `keys` name the vocabulary size and document count in the messages (the command line's
    flags)."""
    check_tokenizer_request(kind, vocab_size, max_docs, keys)  # before any data is read or written
    pretrain_config = load_pretrain_config(config, overrides)
    return train_tokenizer(pretrain_config.data, output, kind, vocab_size, max_docs, overwrite=overwrite, keys=keys)
