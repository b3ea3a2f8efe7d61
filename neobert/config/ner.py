"""The schema of a token-classification (NER) fine-tuning run (`python -m experiments.ner --task wnut17 key=value`;
docs/ner.md).

The sections every training job shares come from `neobert.config.common`, with the fine-tuning trainer and the
paper's grid of GLUE (`FineTuneTrainerConfig`, `SweepConfig`): AdamW (0.9, 0.95), 6% linear warm-up then linear
decay, validation every n steps, early stopping, the best checkpoint kept, `--sweep` over the grid with seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional

from neobert.config.common import (KERNELS_MOVED, FineTuneDataConfig, FineTuneTrainerConfig, LoggingConfig,
                                   OptimizerConfig, SchedulerConfig, SweepConfig, check_load_time_overrides,
                                   check_optimizer_strategy)
from neobert.config.loader import require

SPLITS = ("train", "validation", "test")


@dataclass
class NerDataConfig(FineTuneDataConfig):
    # Local CoNLL files: a directory holding train.conll and dev.conll (also .txt/.tsv/.iob, validation.*, test.*);
    # null = the task's hub data set (wnut_17, eriktks/conll2003), which needs the hub.
    path: Optional[str] = None
    # Or one file per split, {train: a.conll, validation: b.conll}; each replaces the file found under `path`.
    files: Dict[str, str] = field(default_factory=dict)

    def validate(self, prefix: str = "data") -> None:
        super().validate(prefix)
        unknown = sorted(set(self.files) - set(SPLITS))
        require(not unknown, f"{prefix}.files", f"unknown split(s) {unknown}; the splits are {list(SPLITS)}")


@dataclass
class NerConfig:
    task: str = "wnut17"  # wnut17 | conll2003 (neobert.data.ner.NER_TASKS)
    model: str = "chandar-lab/NeoBERT"  # our export, a local HF directory, a hub name, or preset:tiny
    tokenizer: Optional[str] = None  # default: the one beside the model (a fast tokenizer: word alignment)
    classifier_dropout: float = 0.1
    # NeoBERTConfig fields the loaded model changes (NeoBERT models; other encoders run their own code): kernels,
    # eager | liger (Liger-Kernel's RMSNorm and SwiGLU on a GPU) | quack (QuACK's MLP on a GPU), neobert.model.kernels.
    model_overrides: Dict[str, Any] = field(default_factory=dict)
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

    RENAMED_KEYS: ClassVar[Dict[str, str]] = KERNELS_MOVED

    def validate(self) -> None:
        """Checks the values the types cannot; every message names the key."""
        for section in (self.data, self.optimizer, self.scheduler, self.trainer, self.logging, self.sweep):
            section.validate()
        check_optimizer_strategy(self.optimizer, self.trainer)
        check_load_time_overrides(self.model_overrides)
        require(0 <= self.classifier_dropout < 1, "classifier_dropout", "must be in [0, 1)")
