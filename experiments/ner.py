"""Token classification (NER) fine-tuning: WNUT-17 or CoNLL-2003 with any encoder (docs/ner.md).

    python -m experiments.ner --task wnut17 [--model DIR|HUB_NAME|preset:tiny] [--config ner/wnut17] [--sweep]
                              [key=value ...]

Entity-level precision, recall and F1 (seqeval) on the dev split, which also picks the best checkpoint. Without
`--config`, the task's packaged config `ner/<task>` is used (neobert/configs/ner/<task>.yaml). Local data:
`data.path=DIR` (train.conll, dev.conll) or `data.files.train=... data.files.validation=...`; without them the
hub's data set is read (wnut_17, eriktks/conll2003). Keys: neobert.config.ner.NerConfig.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from neobert.data.ner import NER_TASKS
from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.ner import run_ner


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=list(NER_TASKS))
    parser.add_argument("--model", help="our export dir, a local Hugging Face dir, a hub name, or preset:tiny")
    parser.add_argument("--config", help="YAML config: a path or a packaged name (default: ner/<task>)")
    parser.add_argument("--sweep", action="store_true", help="run the grid of `sweep.*` and report the median")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = run_ner(args.task, args.config, args.model, args.overrides, sweep=args.sweep)
    print(json.dumps({k: summary[k] for k in ("task", "model", "evaluated_on", "scores", "hyperparameters",
                                              "best_run", "best_dir", "train_seconds")}, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(run_cli(main))
