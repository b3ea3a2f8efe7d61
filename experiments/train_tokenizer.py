"""Trains a tokenizer for pretraining on your own data: WordPiece (BERT's kind, the default) or byte-level BPE,
on a pretraining config's data (one source or a mixture, `data.sources`, each by its draw probability), its
vocabulary padded to a multiple of 64, saved in the Hugging Face layout `data.tokenizer` loads:

    python -m experiments.train_tokenizer runs/tok --config recipes/cpu-phases --vocab-size 8192
    python -m experiments.pretrain --config recipes/cpu-phases data.tokenizer=runs/tok

The model's vocab_size follows the tokenizer. An existing tokenizer directory is refused unless --overwrite, which
replaces it as a whole; a directory holding anything but a tokenizer (an export, your files) is never written.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.train_tokenizer import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, TOKENIZER_KINDS, run_train_tokenizer


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="the tokenizer directory to write")
    parser.add_argument("--config", default=None, help="a pretraining config whose data it learns from (default: demo)")
    parser.add_argument("--kind", choices=TOKENIZER_KINDS, default="wordpiece")
    parser.add_argument("--vocab-size", type=int, default=30_528,
                        help=f"at least {MIN_VOCAB_SIZE['wordpiece']} (wordpiece; and its alphabet: the data's "
                             f"characters) or {MIN_VOCAB_SIZE['bpe']} (bpe), at most {MAX_VOCAB_SIZE:,}")
    parser.add_argument("--max-docs", type=int, default=100_000, help="documents read, over all sources (>= 1)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing tokenizer in the output directory (refused otherwise)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the pretraining config")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    directory = run_train_tokenizer(args.output, args.config, args.overrides, args.kind, args.vocab_size,
                                    args.max_docs, args.overwrite, keys=("--vocab-size", "--max-docs"))
    print(f"tokenizer: {directory}; set data.tokenizer={directory}")
    return directory


if __name__ == "__main__":
    sys.exit(run_cli(main))
