"""The schema of a token-classification (NER) fine-tuning run (`python -m experiments.ner --task wnut17 key=value`;
docs/ner.md).

The sections every training job shares come from `neobert.config.common`, with the fine-tuning trainer and the
paper's grid of GLUE (`FineTuneTrainerConfig`, `SweepConfig`): AdamW (0.9, 0.95), 6% linear warm-up then linear
decay, validation every n steps, early stopping, the best checkpoint kept, `--sweep` over the grid with seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from neobert.config.common import (FineTuneTrainerConfig, LoggingConfig, OptimizerConfig, SchedulerConfig,
                                   SweepConfig, check_optimizer_strategy)
from neobert.config.loader import require

SPLITS = ("train", "validation", "test")


@dataclass
class NerDataConfig:
    # Local CoNLL files: a directory holding train.conll and dev.conll (also .txt/.tsv/.iob, validation.*, test.*);
    # null = the task's hub data set (wnut_17, eriktks/conll2003), which needs the hub.
    path: Optional[str] = None
    # Or one file per split, {train: a.conll, validation: b.conll}; each replaces the file found under `path`.
    files: Dict[str, str] = field(default_factory=dict)
    max_length: int = 512  # sub-tokens per sentence (clipped to the tokenizer's limit); longer ones are truncated
    batch_size: int = 32
    eval_batch_size: int = 64
    group_by_length: bool = True  # length-grouped batches: short sentences do not pay for long ones
    num_workers: int = 0
    max_train_examples: int = 0  # 0 = all; otherwise a seeded random subset (quick runs)
    max_eval_examples: int = 0  # 0 = all; otherwise the first N sentences of the validation split

    def validate(self, prefix: str = "data") -> None:
        unknown = sorted(set(self.files) - set(SPLITS))
        require(not unknown, f"{prefix}.files", f"unknown split(s) {unknown}; the splits are {list(SPLITS)}")
        require(self.max_length >= 8, f"{prefix}.max_length", "must be at least 8")
        require(self.batch_size > 0, f"{prefix}.batch_size", "must be positive")
        require(self.eval_batch_size > 0, f"{prefix}.eval_batch_size", "must be positive")
        require(self.num_workers >= 0, f"{prefix}.num_workers", "must be >= 0")
        require(self.max_train_examples >= 0, f"{prefix}.max_train_examples", "must be >= 0 (0 = all)")
        require(self.max_eval_examples >= 0, f"{prefix}.max_eval_examples", "must be >= 0 (0 = all)")


@dataclass
class NerConfig:
    task: str = "wnut17"  # wnut17 | conll2003 (neobert.data.ner.NER_TASKS)
    model: str = "chandar-lab/NeoBERT"  # our export, a local HF directory, a hub name, or preset:tiny
    tokenizer: Optional[str] = None  # default: the one beside the model (a fast tokenizer: word alignment)
    classifier_dropout: float = 0.1
    output_dir: Optional[str] = None  # default: runs/ner/<model name>
    keep_run_checkpoints: bool = False  # the per-run best checkpoints; the task's best model is always kept
    overwrite: bool = False  # replace a finished run in output_dir/<task>/ (refused otherwise)
    data: NerDataConfig = field(default_factory=NerDataConfig)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=5e-5, weight_decay=1e-2, betas=[0.9, 0.95], eps=1e-8))
    scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(name="linear", warmup_steps=0, warmup_fraction=0.06))
    trainer: FineTuneTrainerConfig = field(default_factory=lambda: FineTuneTrainerConfig(eval_every_n_steps=100))
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(log_every_n_steps=50, loggers=["csv"]))
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def validate(self) -> None:
        """Checks the values the types cannot; every message names the key."""
        for section in (self.data, self.optimizer, self.scheduler, self.trainer, self.logging, self.sweep):
            section.validate()
        check_optimizer_strategy(self.optimizer, self.trainer)
        require(0 <= self.classifier_dropout < 1, "classifier_dropout", "must be in [0, 1)")
