"""Contrastive fine-tuning of any encoder with the paper's uniform protocol (paper Section 5.2), then export in
our hub layout + sentence-transformers layout (`<output_dir>/export`). Guide: docs/contrastive_mteb.md.

    python -m experiments.contrastive --config contrastive --model chandar-lab/NeoBERT
    python -m experiments.contrastive --config contrastive --model runs/pretrain/export \
        trainer.devices=8 trainer.strategy=ddp data.batch_size=64 loss.grad_cache_chunk_size=32
    # firewalled: local files replace hub data sets, a local STS file is scored before and after
    python -m experiments.contrastive --config contrastive --model preset:mini \
        'data.datasets=[STSBenchmark]' data.local_files.STSBenchmark=sts-train.csv eval_sts=sts-dev.csv
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from neobert.config import flag_overrides, load_config
from neobert.config.contrastive import ContrastiveConfig
from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.contrastive import run_contrastive


def parse_args(argv=None) -> ContrastiveConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file (or packaged config name, e.g. contrastive) with "
                                         "ContrastiveConfig keys")
    parser.add_argument("--model", help="checkpoint directory, Hugging Face encoder (dir or hub name), preset:<name>")
    parser.add_argument("--output-dir")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    return load_config(ContrastiveConfig, args.config, flag_overrides(args, values=("model", "output_dir")))


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    result = run_contrastive(parse_args(argv))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(run_cli(main))
