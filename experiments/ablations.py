"""The ablation ladder M0..M10 (paper Table 2, Figure 1): pretrain every step at every seed of the budget, score
each checkpoint with one protocol (held-out MLM loss and pseudo-perplexity, an STS probe, a GLUE subset), write
a results table (mean +- sd over seeds, differences to the parent in standard errors) and Figure 1.

    python -m experiments.ablations --steps m00..m10 --budget tiny          # CPU, offline, minutes, one seed
    python -m experiments.ablations --budget cpu                            # CPU, offline, ~2 h, three seeds
    python -m experiments.ablations --steps m00,m01,m02 --budget small --output-dir runs/ablations/small
    python -m experiments.ablations --budget paper trainer.precision=bf16-mixed   # 8 GPUs per step

`key=value` overrides apply to every step's PretrainConfig; `--budget-override seeds=[0,1]` or
`--budget-override glue.tasks=[rte,mrpc]` to the budget. Writes results.json (one row per run), results.md and
figure1_<metric>.png under the output directory. Rerun the same command to resume: finished runs are read
back, an interrupted one continues from its last checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys

from neobert.jobs.ablations import run_ablations
from neobert.jobs.cli import add_debug_flag, print_report, run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="m00..m10", help="e.g. m00..m10, m00,m03 or m00..m02,m05")
    parser.add_argument("--budget", default="tiny", help="tiny, small, paper, or a budget YAML file")
    parser.add_argument("--budget-override", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the budget (repeatable)")
    parser.add_argument("--output-dir", default=None, help="default: runs/ablations/<budget>")
    parser.add_argument("--no-eval", action="store_true", help="pretrain only (no held-out, STS or GLUE scores)")
    parser.add_argument("overrides", nargs="*", help="PretrainConfig key=value overrides for every step")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    results, paths = run_ablations(args.steps, args.budget, args.budget_override, args.output_dir,
                                   evaluate=not args.no_eval, overrides=args.overrides)
    print_report(paths)
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
