"""MTEB evaluation of any of our checkpoints or any Hugging Face encoder, with the per-task instructions applied
(paper Section 5.2, Table 4). Guide: docs/contrastive_mteb.md.

    python -m experiments.mteb --model chandar-lab/NeoBERT --tasks english            # the paper's 56 tasks
    python -m experiments.mteb --model runs/contrastive/export --tasks STSBenchmark,SciFact
    python -m experiments.mteb --model runs/contrastive/export \
        --tasks sts:data/sts-dev.csv,retrieval:data/pairs.jsonl                      # local tasks, no hub
    python -m experiments.mteb --model runs/contrastive/export --tasks beir:SciFact=data/scifact beir_split=test
    python -m experiments.mteb --config mteb instructions=none batch_size=32
    python -m experiments.mteb --model runs/contrastive/export --tasks sts:data/sts-dev.csv --dim 256   # Matryoshka

Writes results.json, summary.json and summary.md (paper Table 4 layout) under output_dir.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from neobert.config import flag_overrides, load_config
from neobert.config.mteb import MtebConfig
from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.mteb import evaluate_model, summary_markdown
from neobert.layout import MTEB_SUMMARY_MD, RESULTS_JSON


def parse_args(argv=None) -> MtebConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file (or packaged config name, e.g. mteb) with MtebConfig keys")
    parser.add_argument("--model", help="checkpoint directory, Hugging Face encoder (dir or hub name), preset:<name>")
    parser.add_argument("--tasks", help="comma-separated: mteb task names, 'english', sts:<file>, retrieval:<file>, "
                                          "beir:<directory> (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)")
    parser.add_argument("--dim", type=int, help="evaluate embeddings truncated to their first DIM dimensions "
                                                "(re-normalised), e.g. after Matryoshka training")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="encoder autocast dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--output-dir")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of MtebConfig")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    overrides = flag_overrides(args, values=("model", "output_dir", "dim", "dtype"), lists=("tasks",))
    return load_config(MtebConfig, args.config, overrides)


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    config = parse_args(argv)
    report = evaluate_model(config)
    print(summary_markdown(report))
    output_dir = Path(config.output_dir)
    print(f"results: {output_dir / RESULTS_JSON}, summary: {output_dir / MTEB_SUMMARY_MD}")
    return report


if __name__ == "__main__":
    sys.exit(run_cli(main))
