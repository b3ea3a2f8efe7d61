"""Throughput of NeoBERT against Hugging Face BERT/RoBERTa/ModernBERT (paper Figure 3, Table 9).

    python -m experiments.throughput                                   # CPU: lengths 128, 512; GPU: 128 ... 4096
    python -m experiments.throughput --models neobert,bert-base,modernbert-base --lengths 512 \
        --batch-sizes 8 --mode inference
    python -m experiments.throughput --config my_throughput.yaml layouts=[full,padded,unpadded]
    python -m experiments.throughput --models neobert,bert-base --lengths 512 profile=true   # where the time goes
    python -m experiments.throughput --models neobert-flash_attn_4 model_overrides.kernels=quack compile=true

Writes throughput.csv, throughput.md (Table 9 layout, ratios per length) and throughput.png (Figure 3); with
profile=true, throughput_profile.csv, throughput_profile_names.csv and each profiled step's Chrome trace in
throughput_traces/ (docs/ablations.md).

    python -m experiments.throughput --report a/throughput.csv b/throughput.csv --output-dir runs/merged

re-makes the CSV, the Markdown tables and the plot from rows measured earlier (earlier runs' CSVs), running no model.
"""

from __future__ import annotations

import argparse
import logging
import sys

from neobert.config import ConfigError, flag_overrides, load_config
from neobert.config.throughput import MODEL_NAMES, ThroughputConfig
from neobert.instruments.throughput import report_from_csvs, run_throughput_job
from neobert.jobs.cli import add_debug_flag, print_report, run_cli

MEASUREMENT_FLAGS = ("config", "models", "lengths", "batch_sizes", "layouts", "mode", "overrides")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with ThroughputConfig keys")
    parser.add_argument("--models", help="comma-separated, any of: " + ",".join(MODEL_NAMES))
    parser.add_argument("--lengths", help="comma-separated sequence lengths, e.g. 128,512,1024")
    parser.add_argument("--batch-sizes", help="comma-separated candidates; one value fixes the batch size")
    parser.add_argument("--layouts", help="comma-separated: full,padded,unpadded")
    parser.add_argument("--mode", choices=["inference", "training"])
    parser.add_argument("--output-dir")
    parser.add_argument("--report", nargs="+", metavar="CSV",
                        help="re-make the reports from these throughput CSVs (in --output-dir); no model runs")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the report --output-dir already holds (its files and nothing else)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of ThroughputConfig")
    add_debug_flag(parser)
    return parser


def config_of(args: argparse.Namespace) -> ThroughputConfig:
    overrides = flag_overrides(args, values=("mode", "output_dir"),
                               lists=("models", "lengths", "batch_sizes", "layouts"))
    return load_config(ThroughputConfig, args.config, overrides)


def parse_args(argv=None) -> ThroughputConfig:
    return config_of(build_parser().parse_intermixed_args(argv))  # key=value overrides may follow any flag


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    args = build_parser().parse_intermixed_args(argv)
    if args.report:
        if given := [name for name in MEASUREMENT_FLAGS if getattr(args, name)]:
            flag = "key=value overrides" if given[0] == "overrides" else "--" + given[0].replace("_", "-")
            raise ConfigError(f"--report re-makes reports from CSVs, so {flag} has nothing to act on: give "
                              f"--report the CSVs and --output-dir only")
        paths = report_from_csvs(args.report, args.output_dir or ThroughputConfig.output_dir, args.overwrite)
    else:
        paths = run_throughput_job(config_of(args), args.overwrite)
    print_report(paths)
    return paths


if __name__ == "__main__":
    sys.exit(run_cli(main))
