"""Pseudo-perplexity against document length (paper Figure 2).

    python -m experiments.pseudo_perplexity models=[runs/neobert/export]            # English Wikipedia (hub)
    python -m experiments.pseudo_perplexity models=[runs/a/export,runs/b/export] \
        data.source=my_docs/ data.text_sample_by=document bucket_edges=[128,512,1024,4096]

Writes documents.csv, buckets.json, pseudo_perplexity.md and pseudo_perplexity.png under output_dir.
"""

from __future__ import annotations

import argparse
import logging
import sys

from neobert.config import load_config
from neobert.config.pseudo_perplexity import PseudoPerplexityConfig
from neobert.jobs.cli import add_debug_flag, print_report, run_cli
from neobert.jobs.pseudo_perplexity import run_pseudo_perplexity_job


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with PseudoPerplexityConfig keys")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    paths = run_pseudo_perplexity_job(load_config(PseudoPerplexityConfig, args.config, args.overrides))
    print_report(paths)
    return paths


if __name__ == "__main__":
    sys.exit(run_cli(main))
