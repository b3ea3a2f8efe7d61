"""The schema of a GLUE fine-tuning run (`python -m experiments.glue --task rte key=value ...`; docs/glue.md).

Defaults are the paper's fine-tuning protocol (paper Table 3 and the fine-tuning appendix): AdamW with betas
(0.9, 0.95), 6% linear warm-up then linear decay to 0, up to 10 epochs with validation every n steps, the best
checkpoint kept. The same for every backbone, so NeoBERT and any Hugging Face encoder are compared alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional

from neobert.config.common import (KERNELS_MOVED, LOGGING_KEYS_MOVED, OPTIMIZER_KEYS, FineTuneDataConfig,
                                   FineTuneTrainerConfig, LoggingConfig, OptimizerConfig, SchedulerConfig, SweepConfig,
                                   check_load_time_overrides, check_optimizer_strategy)
from neobert.config.loader import require


@dataclass
class GlueDataConfig(FineTuneDataConfig):
    path: Optional[str] = None  # local GLUE files (hub parquet or original TSV layout); None = the hub's nyu-mll/glue
    max_length: int = 1024  # the paper's NeoBERT value; clipped to what the tokenizer/model accepts
    batch_size: int = 16


@dataclass
class GlueTrainerConfig(FineTuneTrainerConfig):
    """The fine-tuning trainer section (`neobert.config.common.FineTuneTrainerConfig`) with GLUE's defaults."""


GlueSweepConfig = SweepConfig  # the paper's grid, shared by every fine-tuning job


@dataclass
class GlueConfig:
    task: str = "rte"
    model: str = "chandar-lab/NeoBERT"  # our export, a local HF directory, a hub name, or preset:tiny
    tokenizer: Optional[str] = None  # default: the one beside the model
    classifier_dropout: float = 0.1
    # NeoBERTConfig fields the loaded model changes (NeoBERT models; other encoders run their own code): kernels,
    # eager | liger (Liger-Kernel's RMSNorm and SwiGLU on a GPU) | quack (QuACK's MLP on a GPU), neobert.model.kernels.
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    # "mnli": start from the best MNLI model under output_dir (the paper does this for RTE, MRPC, STS-B);
    # or a directory holding a fine-tuned model.safetensors of the same backbone.
    transfer_from: Optional[str] = None
    output_dir: Optional[str] = None  # default: runs/glue/<model name>, so transfers never mix backbones
    predict: bool = False  # write test-split predictions of the best model (GLUE submission TSVs)
    keep_run_checkpoints: bool = False  # the per-run best checkpoints; the task's best model is always kept
    # A task whose output_dir/<task>/ holds a finished run (results.json, best/) is refused unless this is set; it
    # then removes what the suite wrote there first, nothing else (a new result is never mixed with an earlier one's).
    overwrite: bool = False
    data: GlueDataConfig = field(default_factory=GlueDataConfig)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=2e-5, weight_decay=1e-2, betas=[0.9, 0.95], eps=1e-8))
    # 6% warm-up, then linear decay to 0
    scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(name="linear", warmup_steps=0, warmup_fraction=0.06))
    trainer: GlueTrainerConfig = field(default_factory=GlueTrainerConfig)
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(log_every_n_steps=50, loggers=["csv"]))
    sweep: GlueSweepConfig = field(default_factory=GlueSweepConfig)

    RENAMED_KEYS: ClassVar[Dict[str, str]] = {
        **{f"optim.{key}": f"optimizer.{key}" for key in OPTIMIZER_KEYS},
        "optim.warmup_fraction": "scheduler.warmup_fraction",
        "optim.gradient_clip_val": "trainer.gradient_clip_val",
        **LOGGING_KEYS_MOVED,
        **KERNELS_MOVED,
    }

    def validate(self) -> None:
        """Checks the values the types cannot; every message names the key."""
        for section in (self.data, self.optimizer, self.scheduler, self.trainer, self.logging, self.sweep):
            section.validate()
        check_optimizer_strategy(self.optimizer, self.trainer)
        check_load_time_overrides(self.model_overrides)
        require(0 <= self.classifier_dropout < 1, "classifier_dropout", "must be in [0, 1)")
