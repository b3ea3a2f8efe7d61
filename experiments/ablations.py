"""The ablation ladder M0..M10 (paper Table 2, Figure 1): pretrain every step, fine-tune each checkpoint on a
GLUE subset, write a results table.

    python -m experiments.ablations --steps m00..m10 --budget tiny          # CPU, offline, minutes
    python -m experiments.ablations --steps m00,m01,m02 --budget small --output-dir runs/ablations/small
    python -m experiments.ablations --budget paper trainer.precision=bf16-mixed   # 8 GPUs per step

`key=value` overrides apply to every step's PretrainConfig; `--budget-override glue.tasks=[rte,mrpc]` to the
budget. Writes results.json, results.md and glue_per_step.png under the output directory; a step whose export
already exists is not retrained (rerun to resume a ladder).
"""

from __future__ import annotations

import argparse
import logging
import sys

from neobert.jobs.ablations import run_ablations
from neobert.jobs.cli import add_debug_flag, run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="m00..m10", help="e.g. m00..m10, m00,m03 or m00..m02,m05")
    parser.add_argument("--budget", default="tiny", help="tiny, small, paper, or a budget YAML file")
    parser.add_argument("--budget-override", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the budget (repeatable)")
    parser.add_argument("--output-dir", default=None, help="default: runs/ablations/<budget>")
    parser.add_argument("--no-glue", action="store_true", help="pretrain only")
    parser.add_argument("overrides", nargs="*", help="PretrainConfig key=value overrides for every step")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    results, paths = run_ablations(args.steps, args.budget, args.budget_override, args.output_dir,
                                   evaluate=not args.no_glue, overrides=args.overrides)
    print(paths["markdown"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
