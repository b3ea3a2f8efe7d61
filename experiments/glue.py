"""GLUE fine-tuning with the paper's protocol (paper Table 3 and the fine-tuning appendix; docs/glue.md).

    python -m experiments.glue --task rte [--model DIR|HUB_NAME|preset:tiny] [--config glue/rte] [--sweep]
                               [key=value ...]

`--task all` runs every task (MNLI first, so RTE, MRPC and STS-B can start from it) and writes
`<output_dir>/glue_results.{json,md}` in the paper's Table 3 layout. Without `--config`, the task's packaged
config `glue/<task>` is used (neobert/configs/glue/<task>.yaml). Keys: neobert.config.glue.GlueConfig
(e.g. `data.path=../glue optimizer.lr=3e-5 logging.progress_bar=false`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from neobert.data.glue import GLUE_TASKS
from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.glue import run_glue


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=[*GLUE_TASKS, "all"])
    parser.add_argument("--model", help="our export dir, a local Hugging Face dir, a hub name, or preset:tiny")
    parser.add_argument("--config", help="YAML config: a path or a packaged name (default: glue/<task>)")
    parser.add_argument("--sweep", action="store_true", help="run the grid of `sweep.*` and report the median")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run_glue(args.task, args.config, args.model, args.overrides, sweep=args.sweep)
    print(json.dumps(results if args.task != "all" else {t: r["scores"] for t, r in results.items()}, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
