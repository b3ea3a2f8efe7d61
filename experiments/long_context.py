"""Long-context retrieval, offline: LongEmbed's synthetic passkey and needle tasks generated with a fixed seed at
256, 512, 1,024, 2,048 and 4,096 tokens of each model's own tokenizer (only up to its max_length), scored per
length (nDCG@1 = top-1 accuracy among the documents of that length) and plotted. Guide: docs/contrastive_mteb.md.

    python -m experiments.long_context --model runs/contrastive/export
    python -m experiments.long_context --model neobert-1024=runs/a/export --model neobert-4096=runs/b/export
    python -m experiments.long_context --model <...> lengths=[128,256] examples_per_length=50 tasks=[passkey]

Writes long_context.json, long_context.md, long_context.png and data/<model>_<task>.jsonl under output_dir.
"""

from __future__ import annotations

import argparse
import logging
import sys

from neobert.config import load_config
from neobert.config.long_context import LongContextConfig
from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.long_context import run_long_context


def parse_args(argv=None) -> LongContextConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with LongContextConfig keys")
    parser.add_argument("--model", action="append", help="a model (checkpoint dir, HF dir or hub name, preset:<name>), "
                                                         "optionally label=path; repeat to compare models")
    parser.add_argument("--output-dir")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of LongContextConfig")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"models=[{','.join(repr(m) for m in args.model)}]")
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    return load_config(LongContextConfig, args.config, overrides)


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    report = run_long_context(parse_args(argv))
    print(report["table"])
    print(f"results: {report['json']}, plot: {report['plot']}")
    return report


if __name__ == "__main__":
    sys.exit(run_cli(main))
