"""What the plain Hugging Face `Trainer` baselines (hf_trainer_glue.py, hf_trainer_ner.py, hf_trainer_mlm.py) share:
their command line, the suite's fine-tuning hyperparameters as `TrainingArguments`, the best evaluation, and the
results file."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments


def script_parser(doc: str, output_dir: str) -> argparse.ArgumentParser:
    """The options of every baseline: --threads and --output-dir."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--output-dir", default=output_dir)
    return parser


def baseline_parser(doc: str, *, task: str | None, data_path_help: str, batch_size: int, lr: float, eval_every: int,
                    output_dir: str) -> argparse.ArgumentParser:
    """The options of the fine-tuning baselines, with each one's defaults (`task=None`: --task is required); a
    baseline adds its own options to the parser."""
    parser = script_parser(doc, output_dir)
    parser.add_argument("--task", **({"default": task} if task else {"required": True}))
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory (or hub name)")
    parser.add_argument("--data-path", required=True, help=data_path_help)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--max-steps", type=int, default=-1, help="> 0 caps the run")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=eval_every)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed options, with `--threads` applied before any tokenizing or training."""
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    """The suite's fine-tuning hyperparameters: AdamW betas (0.9, 0.95), 6% warm-up then linear decay, weight decay,
    gradient clipping 1.0, evaluation (and logging) every `--eval-every` steps, on the CPU, no checkpoints."""
    return TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size, learning_rate=args.lr, weight_decay=args.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, warmup_steps=0.06,
        lr_scheduler_type="linear", num_train_epochs=args.epochs, max_steps=args.max_steps,
        eval_strategy="steps", eval_steps=args.eval_every,
        save_strategy="no", logging_steps=args.eval_every, seed=args.seed, report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)


def train_keeping_best(trainer: Trainer, score_key: str) -> tuple[float, list[dict], dict]:
    """Trains; returns (training seconds, every evaluation logged, the one with the best `score_key`)."""
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    evaluations = [entry for entry in trainer.state.log_history if score_key in entry]
    return seconds, evaluations, max(evaluations, key=lambda entry: entry[score_key])


def write_results(output_dir: str, result: dict,
                  headline: tuple[str, ...] = ("task", "train_seconds", "steps", "best_step", "scores")) -> None:
    """`<output_dir>/results.json`, and its `headline` numbers printed."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in headline}, indent=2))
