"""Writes the offline prose corpus (the documentation and docstrings that CPython and the installed packages ship;
`neobert/data/offline_corpus.py`) as JSON lines with a `content` column, for pretraining on a machine without
the hub, beyond the demo's 0.5 MB:

    python -m experiments.offline_corpus runs/offline_corpus.jsonl
    python -m experiments.pretrain data.source=runs/offline_corpus.jsonl output_dir=runs/offline

Prints the number of documents, characters and the content hash (the corpus depends on what is installed).
"""

from __future__ import annotations

import argparse
import json
import sys

from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.offline_corpus import run_offline_corpus


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="the .jsonl file to write (kept when it exists)")
    parser.add_argument("--roots", nargs="+", help="folders to read (default: this Python's standard library and "
                                                   "site-packages)")
    parser.add_argument("--max-chars", type=int, default=1000, help="longest document, in characters")
    parser.add_argument("--min-words", type=int, default=12, help="shortest paragraph kept, in words")
    parser.add_argument("--shuffle-seed", type=int, help="write the documents in this seeded random order "
                                                         "(default: file order)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    summary = run_offline_corpus(args.output, args.roots, args.max_chars, args.min_words, args.shuffle_seed)
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(run_cli(main))
