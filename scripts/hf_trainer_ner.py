"""The plain Hugging Face `Trainer` baseline for NER, to compare with `python -m experiments.ner`: the same files
(read by the same CoNLL reader), the same first-sub-token labelling (the same tokenized sentences), the same metric
(seqeval entity F1 over each sentence's full gold tags, `neobert.eval.ner_metrics`), the same hyperparameters
(AdamW betas (0.9, 0.95), 6% warm-up then linear decay, weight decay, gradient clipping 1.0, evaluation every n
steps, best evaluation reported), but the stock `AutoModelForTokenClassification`, `DataCollatorForTokenClassification`
(dynamic padding, random batches) and `Trainer` loop.

    python scripts/hf_trainer_ner.py --task wnut17 --model DIR --data-path ../shared/data/ner/wnut17 \
        --batch-size 32 --lr 1e-4 --max-steps 300 --max-length 128 --eval-every 100 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                          Trainer, TrainingArguments)

from neobert.config.ner import NerDataConfig
from neobert.data.ner import TokenizedNer, get_ner_task, load_ner_split
from neobert.eval.ner_metrics import entity_scores, word_tags


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="wnut17")
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory (or hub name)")
    parser.add_argument("--data-path", required=True, help="local CoNLL files, as `data.path` of experiments.ner")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--max-steps", type=int, default=-1, help="> 0 caps the run")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--max-train-examples", type=int, default=0)
    parser.add_argument("--max-eval-examples", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/hf_trainer_ner")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    task = get_ner_task(args.task)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = NerDataConfig(path=args.data_path)

    def tokenized(split: str, limit: int) -> TokenizedNer:
        sentences = load_ner_split(task, split, data)
        if limit and limit < len(sentences):  # the same subsets as experiments.ner's max_*_examples
            order = (torch.randperm(len(sentences), generator=torch.Generator().manual_seed(0)).tolist()
                     if split == "train" else list(range(len(sentences))))
            sentences = sentences.select(sorted(order[:limit]))
        return TokenizedNer(sentences, task, tokenizer, args.max_length, f"{task.name}/{split}")

    train, validation = tokenized("train", args.max_train_examples), tokenized("validation", args.max_eval_examples)
    as_dataset = lambda t: Dataset.from_dict({"input_ids": t.input_ids, "labels": t.labels})  # noqa: E731
    id2label = dict(enumerate(task.labels))
    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(task.labels), id2label=id2label, label2id={v: k for k, v in id2label.items()},
        classifier_dropout=0.1)

    def compute_metrics(prediction) -> dict:
        ids = np.asarray(prediction.predictions).argmax(-1)  # [sentences, padded length], dev order
        predicted = [word_tags(len(validation.tags[i]), validation.word_positions[i], ids[i], task.labels)
                     for i in range(len(validation))]
        return entity_scores(validation.tags, predicted)

    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size, learning_rate=args.lr, weight_decay=args.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, warmup_steps=0.06,
        lr_scheduler_type="linear", num_train_epochs=args.epochs, max_steps=args.max_steps,
        eval_strategy="steps", eval_steps=args.eval_every,
        save_strategy="no", logging_steps=args.eval_every, seed=args.seed, report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=as_dataset(train),
                      eval_dataset=as_dataset(validation), data_collator=DataCollatorForTokenClassification(tokenizer),
                      compute_metrics=compute_metrics)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    evaluations = [entry for entry in trainer.state.log_history if "eval_f1" in entry]
    best = max(evaluations, key=lambda entry: entry["eval_f1"])
    result = {"task": task.name, "model": args.model, "train_seconds": seconds, "steps": trainer.state.global_step,
              "best_step": best["step"], "evaluated_on": "validation",
              "scores": {k.removeprefix("eval_"): best[k] for k in ("eval_precision", "eval_recall", "eval_f1",
                                                                    "eval_accuracy")},
              "evaluations": evaluations}
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("task", "train_seconds", "steps", "best_step", "scores")}, indent=2))
    return result


if __name__ == "__main__":
    main()
