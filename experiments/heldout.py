"""Held-out MLM loss of exported models per source, one table (neobert/jobs/heldout.py):

    python -m experiments.heldout phased/s0=runs/bench25/phased-s0/export/decay single/s0=runs/bench25/single-s0/export \
        --source topics=runs/demo/corpus.jsonl --source stdlib=runs/offline/stdlib.jsonl \
        --documents 32 --max-length 256 --mask-rate 0.2 --output-dir runs/bench25

Labels `group/seed` are also averaged per group (mean and standard deviation).
"""

from __future__ import annotations

import argparse
import sys

from neobert.errors import UserInputError
from neobert.jobs.cli import add_debug_flag, print_report, run_cli
from neobert.jobs.heldout import heldout_job


def pairs(items, form: str) -> dict[str, str]:
    named = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in named:
            raise UserInputError(f"expected distinct {form}, got {item!r}")
        named[name] = path
    return named


def positive_int(text: str) -> int:
    if not text.lstrip("-").isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def length(text: str) -> int:
    if not text.lstrip("-").isdigit() or int(text) < 8:  # data.max_length's floor: [CLS], [SEP] and a few tokens
        raise argparse.ArgumentTypeError(f"must be an integer of at least 8, got {text!r}")
    return int(text)


def rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < 1:  # masking.rate's range
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}")
    return value


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="LABEL=EXPORT_DIR")
    parser.add_argument("--source", action="append", required=True, metavar="NAME=CORPUS",
                        help="a local corpus whose first --documents documents the runs held out")
    parser.add_argument("--documents", type=positive_int, default=32)
    parser.add_argument("--max-length", type=length, default=128)
    parser.add_argument("--mask-rate", type=rate, default=0.2)
    parser.add_argument("--output-dir", required=True)
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    paths = heldout_job(pairs(args.models, "LABEL=EXPORT_DIR"), pairs(args.source, "NAME=CORPUS"), args.output_dir,
                        args.documents, args.max_length, args.mask_rate)
    print_report(paths)
    return paths


if __name__ == "__main__":
    sys.exit(run_cli(main))
