"""GLUE fine-tuning with the paper's protocol (paper Table 3 and the fine-tuning appendix; docs/glue.md).

    python -m experiments.glue --task rte [--model DIR|HUB_NAME|preset:tiny] [--config glue/rte] [--sweep]
                               [key=value ...]

`--task all` runs every task (MNLI first, so RTE, MRPC and STS-B can start from it) and writes
`<output_dir>/glue_results.{json,md}` in the paper's Table 3 layout. Without `--config`, the task's packaged
config `glue/<task>` is used (neobert/configs/glue/<task>.yaml). Keys: neobert.config.glue.GlueConfig
(e.g. `data.path=../glue optimizer.lr=3e-5 logging.progress_bar=false`).
"""

from __future__ import annotations

import json
import sys

from neobert.jobs.cli import parse_fine_tuning_args, run_cli
from neobert.jobs.glue import GLUE_TASKS, run_glue


def main(argv: list[str] | None = None) -> dict:
    args = parse_fine_tuning_args(__doc__, [*GLUE_TASKS, "all"], "glue", argv)
    results = run_glue(args.task, args.config, args.model, args.overrides, sweep=args.sweep)
    print(json.dumps(results if args.task != "all" else {t: r["scores"] for t, r in results.items()}, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
