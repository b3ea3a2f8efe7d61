"""The schema of a pretraining run (`python -m experiments.pretrain --config neobert key=value ...`).

This schema is a contract: the ablation configs (M0..M10) are written over these keys. Defaults are the paper's
stage-1 recipe (NeoBERT paper, Section 3 and Table 1) except for the trainer's sizes, which `configs/neobert.yaml`
sets. `PretrainConfig.validate` checks what the types cannot, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from neobert.config.common import LoggingConfig, OptimizerConfig, SchedulerConfig, TrainerConfig
from neobert.config.loader import require

MASKING_STRATEGIES = ("all_mask", "bert")


@dataclass
class ModelConfig:
    preset: str = "neobert"
    # Any NeoBERTConfig field, e.g. position_encoding, activation, norm, max_length, attention_backend, dropout.
    overrides: Dict[str, Any] = field(default_factory=dict)
    compile: bool = False  # torch.compile the model
    masked_only_logits: bool = True  # project to the vocabulary at masked positions only


@dataclass
class PretrainDataConfig:
    # A hub dataset name, or local files: a file, a directory or a glob of .txt/.jsonl/.json/.parquet/.csv.
    source: str = "tiiuae/falcon-refinedweb"
    hub_config: Optional[str] = None
    split: str = "train"
    text_column: str = "content"
    # How .txt files are cut into documents: "paragraph" (blank-line separated), "line" or "document" (a file).
    text_sample_by: str = "paragraph"
    tokenizer: str = "google-bert/bert-base-uncased"  # a hub name or a local tokenizer directory
    max_length: int = 1024
    packing: bool = False  # documents end to end with cu_seqlens (no cross-document attention, no [PAD])
    # Documents are read in blocks of this many and each block is shuffled (exactly resumable); 1 = no shuffle.
    shuffle_buffer: int = 10_000
    # Stage 2: sample documents of >= length_buckets[i] tokens with probability bucket_probabilities[i].
    length_buckets: List[int] = field(default_factory=list)
    bucket_probabilities: List[float] = field(default_factory=list)
    bucket_queue_docs: int = 32  # documents held per bucket while waiting to be drawn
    pretokenized_dir: Optional[str] = None  # parquet shards written by `experiments.pretrain --pretokenize`
    num_workers: int = 2
    validation_docs: int = 0  # the first N documents are held out for a validation loss (0 = none)
    validation_batches: int = 0  # cap on validation batches per check (0 = all)
    # The unigram-entropy baseline (the loss of a context-free model) over this many training documents; 0 = off.
    baseline_docs: int = 0
    seed: int = 0


@dataclass
class MaskingConfig:
    rate: float = 0.2
    strategy: str = "all_mask"  # "all_mask": 100% [MASK] (NeoBERT); "bert": 80% [MASK] / 10% random / 10% kept
    pad_to_multiple_of: int = 8


@dataclass
class PretrainTrainerConfig(TrainerConfig):
    max_steps: int = 1_000_000
    micro_batch_size: int = 32  # sequences per device per forward; x accumulation x devices = the batch
    eval_every_n_steps: int = 1000  # validation loss every N optimizer steps (needs data.validation_docs)
    checkpoint_every_n_steps: int = 1000
    keep_checkpoints: int = 3  # step checkpoints kept besides last.ckpt (-1 = all)

    def validate(self, prefix: str = "trainer") -> None:
        super().validate(prefix)
        require(self.max_steps > 0, f"{prefix}.max_steps", "must be positive")
        require(self.micro_batch_size > 0, f"{prefix}.micro_batch_size", "must be positive")
        require(self.checkpoint_every_n_steps > 0, f"{prefix}.checkpoint_every_n_steps", "must be positive")
        require(self.eval_every_n_steps > 0, f"{prefix}.eval_every_n_steps", "must be positive")


@dataclass
class GlueCallbackConfig:
    """Every `every_n_steps` pretraining steps, fine-tune a copy of the encoder briefly on one GLUE task and
    log its validation score. 0 = off."""

    every_n_steps: int = 0
    task: str = "rte"
    data_path: Optional[str] = None  # local GLUE files (parquet or TSV layout); None = the hub's nyu-mll/glue
    max_train_steps: int = 200
    batch_size: int = 16
    lr: float = 2e-5
    max_length: int = 128
    max_eval_examples: int = 1000

    def validate(self, prefix: str = "glue_callback") -> None:
        require(self.every_n_steps >= 0, f"{prefix}.every_n_steps", "must be >= 0 (0 = off)")
        require(self.max_train_steps > 0, f"{prefix}.max_train_steps", "must be positive")


@dataclass
class MtebCallbackConfig:
    """Every `every_n_steps` pretraining steps, a quick zero-shot evaluation of the encoder on a small local STS
    or retrieval task, logged. 0 = off."""

    every_n_steps: int = 0
    task: str = "sts"  # "sts" (pairs with scores) or "retrieval"
    data_path: Optional[str] = None  # e.g. an STS Benchmark CSV (sts-dev.csv layout)
    max_examples: int = 500
    batch_size: int = 64
    max_length: int = 128

    def validate(self, prefix: str = "mteb_callback") -> None:
        require(self.every_n_steps >= 0, f"{prefix}.every_n_steps", "must be >= 0 (0 = off)")
        require(self.task in ("sts", "retrieval"), f"{prefix}.task", "must be 'sts' or 'retrieval'")
        require(self.every_n_steps == 0 or bool(self.data_path), f"{prefix}.data_path",
                "the MTEB callback needs a local task file (an STS Benchmark CSV for task=sts, a query/positive "
                "jsonl for task=retrieval)")


@dataclass
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PretrainDataConfig = field(default_factory=PretrainDataConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: PretrainTrainerConfig = field(default_factory=PretrainTrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output_dir: str = "runs/neobert"  # checkpoints, logs, plot and export go under it
    resume: bool = False  # continue from output_dir/checkpoints/last.ckpt
    init_from: Optional[str] = None  # weights to start from: an export directory or a Lightning .ckpt
    export_dir: Optional[str] = None  # default: output_dir/export
    glue_callback: GlueCallbackConfig = field(default_factory=GlueCallbackConfig)
    mteb_callback: MtebCallbackConfig = field(default_factory=MtebCallbackConfig)

    RENAMED_KEYS: ClassVar[Dict[str, str]] = {
        "run_dir": "output_dir",
        "trainer.compile": "model.compile",
        "trainer.masked_only_logits": "model.masked_only_logits",
        "trainer.progress_bar": "logging.progress_bar",
        "trainer.log_every_n_steps": "logging.log_every_n_steps",
        "trainer.val_check_interval": "trainer.eval_every_n_steps",
    }

    def validate(self) -> None:
        """Checks the values the types cannot; every message names the key."""
        data, masking = self.data, self.masking
        for section in (self.optimizer, self.scheduler, self.trainer, self.logging, self.glue_callback,
                        self.mteb_callback):
            section.validate()
        require(masking.strategy in MASKING_STRATEGIES, "masking.strategy", f"must be one of {MASKING_STRATEGIES}")
        require(0.0 < masking.rate < 1.0, "masking.rate", f"must be in (0, 1), got {masking.rate}")
        require(masking.pad_to_multiple_of >= 1, "masking.pad_to_multiple_of", "must be >= 1")
        require(data.max_length >= 8, "data.max_length", "must be at least 8")
        require(data.shuffle_buffer >= 1, "data.shuffle_buffer", "must be >= 1 (1 = no shuffling)")
        require(data.num_workers >= 0, "data.num_workers", "must be >= 0")
        require(data.validation_docs >= 0, "data.validation_docs", "must be >= 0")
        require(data.text_sample_by in ("paragraph", "line", "document"), "data.text_sample_by",
                "must be paragraph, line or document")
        require(len(data.length_buckets) == len(data.bucket_probabilities), "data.bucket_probabilities",
                f"needs one probability per entry of data.length_buckets ({len(data.length_buckets)})")
        if data.length_buckets:
            require(list(data.length_buckets) == sorted(data.length_buckets) and data.length_buckets[0] >= 0,
                    "data.length_buckets", "must be non-negative and increasing, e.g. [0, 1024, 2048]")
            require(all(p >= 0 for p in data.bucket_probabilities)
                    and abs(sum(data.bucket_probabilities) - 1) < 1e-6,
                    "data.bucket_probabilities", "must be non-negative and sum to 1")
            require(data.bucket_queue_docs >= 1, "data.bucket_queue_docs", "must be >= 1")
