"""Runs side by side: the loss curves of every run in one plot per metric, and a table of final losses and median
training tokens/s with ratios to the first run. For bf16-mixed against fp32 on the demo:

    python -m experiments.pretrain trainer.max_steps=100 output_dir=runs/precision/fp32
    python -m experiments.pretrain trainer.max_steps=100 output_dir=runs/precision/bf16 trainer.precision=bf16-mixed
    python -m experiments.compare_runs fp32=runs/precision/fp32 bf16-mixed=runs/precision/bf16 \
        --output-dir runs/precision
"""

from __future__ import annotations

import argparse
import sys

from neobert.errors import UserInputError
from neobert.jobs.cli import add_debug_flag, print_report, run_cli
from neobert.jobs.compare_runs import DEFAULT_KEYS, compare_runs_job


def parse_runs(items) -> dict[str, str]:
    runs = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise UserInputError(f"a run is LABEL=OUTPUT_DIR, got {item!r}")
        if label in runs:
            raise UserInputError(f"run label {label!r} given twice")
        runs[label] = path
    return runs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="LABEL=OUTPUT_DIR", help="the first run is the reference")
    parser.add_argument("--output-dir", required=True, help="where the plots and comparison.md go")
    parser.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma-separated logged metrics to plot")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    paths = compare_runs_job(parse_runs(args.runs), args.output_dir, [k for k in args.keys.split(",") if k])
    print_report(paths)
    return paths


if __name__ == "__main__":
    sys.exit(run_cli(main))
