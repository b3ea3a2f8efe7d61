"""The plain Hugging Face `Trainer` baseline for GLUE, to compare with `python -m experiments.glue`: the same files
(read by the same loader), the same metrics code, the same hyperparameters (AdamW betas (0.9, 0.95), 6% warm-up
then linear decay, weight decay, gradient clipping 1.0, evaluation every n steps, best evaluation reported), but
the stock `AutoModelForSequenceClassification` and `Trainer` loop.

    python scripts/hf_trainer_glue.py --task stsb --model DIR --data-path ../shared/data/glue \
        --batch-size 16 --lr 3e-5 --weight-decay 0.01 --epochs 1 --max-length 128 --eval-every 90 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                          TrainingArguments)

from neobert.data.glue import get_task, load_glue_split
from neobert.eval.glue_metrics import compute_glue_metrics, main_score_key


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True)
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory (or hub name)")
    parser.add_argument("--data-path", required=True, help="local GLUE files, as `data.path` of experiments.glue")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--max-steps", type=int, default=-1, help="> 0 caps the run")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/hf_trainer_glue")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

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

    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size, learning_rate=args.lr, weight_decay=args.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, warmup_steps=0.06,
        lr_scheduler_type="linear", num_train_epochs=args.epochs, max_steps=args.max_steps,
        eval_strategy="steps", eval_steps=args.eval_every,
        save_strategy="no", logging_steps=args.eval_every, seed=args.seed, report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=validation,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=compute_metrics)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    key = "eval_" + main_score_key(task)
    evaluations = [entry for entry in trainer.state.log_history if key in entry]
    best = max(evaluations, key=lambda entry: entry[key])
    result = {"task": task.name, "model": args.model, "train_seconds": seconds, "steps": trainer.state.global_step,
              "best_step": best["step"], "scores": {k.removeprefix("eval_"): best[k] for k in best
                                                     if k.removeprefix("eval_") in {*task.metrics}},
              "evaluations": evaluations}
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("task", "train_seconds", "steps", "best_step", "scores")}, indent=2))
    return result


if __name__ == "__main__":
    main()
