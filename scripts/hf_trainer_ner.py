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

import sys
from pathlib import Path

import numpy as np
from datasets import Dataset
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification, Trainer

from neobert.config.ner import NerDataConfig
from neobert.data.ner import TokenizedNer, example_subset, get_ner_task, load_ner_split
from neobert.eval.ner_metrics import entity_scores, word_tags

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_trainer_baseline.py, also when loaded by file path
from hf_trainer_baseline import (baseline_parser, parse_args, train_keeping_best, training_arguments,  # noqa: E402
                                 write_results)


def main(argv: list[str] | None = None) -> dict:
    parser = baseline_parser(__doc__, task="wnut17",
                             data_path_help="local CoNLL files, as `data.path` of experiments.ner",
                             batch_size=32, lr=5e-5, eval_every=100, output_dir="runs/hf_trainer_ner")
    parser.add_argument("--max-train-examples", type=int, default=0)
    parser.add_argument("--max-eval-examples", type=int, default=0)
    args = parse_args(parser, argv)

    task = get_ner_task(args.task)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = NerDataConfig(path=args.data_path)

    def tokenized(split: str, limit: int) -> TokenizedNer:
        sentences = example_subset(load_ner_split(task, split, data), split, limit)  # experiments.ner's subsets
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

    trainer = Trainer(model=model, args=training_arguments(args), train_dataset=as_dataset(train),
                      eval_dataset=as_dataset(validation), data_collator=DataCollatorForTokenClassification(tokenizer),
                      compute_metrics=compute_metrics)
    seconds, evaluations, best = train_keeping_best(trainer, "eval_f1")
    result = {"task": task.name, "model": args.model, "train_seconds": seconds, "steps": trainer.state.global_step,
              "best_step": best["step"], "evaluated_on": "validation",
              "scores": {k.removeprefix("eval_"): best[k] for k in ("eval_precision", "eval_recall", "eval_f1",
                                                                    "eval_accuracy")},
              "evaluations": evaluations}
    write_results(args.output_dir, result)
    return result


if __name__ == "__main__":
    main()
