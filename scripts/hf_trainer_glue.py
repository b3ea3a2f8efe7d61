"""The plain Hugging Face `Trainer` baseline for GLUE, to compare with `python -m experiments.glue`: the same files
(read by the same loader), the same metrics code, the same hyperparameters (AdamW betas (0.9, 0.95), 6% warm-up
then linear decay, weight decay, gradient clipping 1.0, evaluation every n steps, best evaluation reported), but
the stock `AutoModelForSequenceClassification` and `Trainer` loop.

    python scripts/hf_trainer_glue.py --task stsb --model DIR --data-path ../shared/data/glue \
        --batch-size 16 --lr 3e-5 --weight-decay 0.01 --epochs 1 --max-length 128 --eval-every 90 --threads 1
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer

from neobert.data.glue import get_task, load_glue_split
from neobert.eval.glue_metrics import compute_glue_metrics, main_score_key

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_trainer_baseline.py, also when loaded by file path
from hf_trainer_baseline import (baseline_parser, parse_args, train_keeping_best, training_arguments,  # noqa: E402
                                 write_results)


def main(argv: list[str] | None = None) -> dict:
    parser = baseline_parser(__doc__, task=None, data_path_help="local GLUE files, as `data.path` of experiments.glue",
                             batch_size=16, lr=2e-5, eval_every=500, output_dir="runs/hf_trainer_glue")
    args = parse_args(parser, argv)

    task = get_task(args.task)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def tokenized(split: str) -> Dataset:
        dataset = load_glue_split(task, split, args.data_path)
        encoded = tokenizer(*[list(dataset[c]) for c in task.text_columns], truncation=True,
                            max_length=args.max_length)
        return Dataset.from_dict({**encoded, "labels": list(dataset["label"])})

    train, validation = tokenized("train"), tokenized(task.validation_splits[0])
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=task.num_labels)

    def compute_metrics(prediction) -> dict:
        return compute_glue_metrics(task, task.validation_splits[0], np.asarray(prediction.predictions),
                                    np.asarray(prediction.label_ids))

    trainer = Trainer(model=model, args=training_arguments(args), train_dataset=train, eval_dataset=validation,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=compute_metrics)
    seconds, evaluations, best = train_keeping_best(trainer, "eval_" + main_score_key(task))
    result = {"task": task.name, "model": args.model, "train_seconds": seconds, "steps": trainer.state.global_step,
              "best_step": best["step"], "scores": {k.removeprefix("eval_"): best[k] for k in best
                                                     if k.removeprefix("eval_") in {*task.metrics}},
              "evaluations": evaluations}
    write_results(args.output_dir, result)
    return result


if __name__ == "__main__":
    main()
