"""Token classification (NER) fine-tuning: WNUT-17 or CoNLL-2003 with any encoder (docs/ner.md).

    python -m experiments.ner --task wnut17 [--model DIR|HUB_NAME|preset:tiny] [--config ner/wnut17] [--sweep]
                              [key=value ...]

Entity-level precision, recall and F1 (seqeval) on the dev split, which also picks the best checkpoint. Without
`--config`, the task's packaged config `ner/<task>` is used (neobert/configs/ner/<task>.yaml). Local data:
`data.path=DIR` (train.conll, dev.conll) or `data.files.train=... data.files.validation=...`; without them the
hub's data set is read (wnut_17, eriktks/conll2003). Keys: neobert.config.ner.NerConfig.
"""

from __future__ import annotations

import json
import sys

from neobert.jobs.cli import parse_fine_tuning_args, run_cli
from neobert.jobs.ner import NER_TASKS, run_ner


def main(argv: list[str] | None = None) -> dict:
    args = parse_fine_tuning_args(__doc__, list(NER_TASKS), "ner", argv)
    summary = run_ner(args.task, args.config, args.model, args.overrides, sweep=args.sweep)
    print(json.dumps({k: summary[k] for k in ("task", "model", "evaluated_on", "scores", "hyperparameters",
                                              "best_run", "best_dir", "train_seconds")}, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(run_cli(main))
