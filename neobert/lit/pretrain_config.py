"""The typed schema of a pretraining run (`configs/*.yaml` and `key=value` overrides merge over it).

This schema is a contract: the ablation configs (M0..M10) are written over these keys. Defaults are the
paper's stage-1 recipe (NEOBERT_SPEC section 2) except for the trainer's sizes, which `configs/neobert.yaml`
sets. `validate_config` checks what OmegaConf's types cannot, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from neobert.config import ConfigError
from neobert.lit.callback_configs import GlueCallbackConfig, MtebCallbackConfig

MASKING_STRATEGIES = ("all_mask", "bert")
OPTIMIZERS = ("adamw", "adam")
SCHEDULERS = ("cosine", "linear")


@dataclass
class ModelSection:
    preset: str = "neobert"
    # Any NeoBERTConfig field, e.g. position_encoding, activation, norm, max_length, attention_backend, dropout.
    overrides: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataSection:
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
class MaskingSection:
    rate: float = 0.2
    strategy: str = "all_mask"  # "all_mask": 100% [MASK] (NeoBERT); "bert": 80% [MASK] / 10% random / 10% kept
    pad_to_multiple_of: int = 8


@dataclass
class OptimizerSection:
    name: str = "adamw"  # "adamw" | "adam" (coupled L2 decay, the M0 baseline)
    lr: float = 6e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_biases_embeddings: bool = False


@dataclass
class SchedulerSection:
    name: str = "cosine"  # warm-up + cosine to final_ratio over decay_fraction | "linear": warm-up + linear to 0
    warmup_steps: int = 2000
    decay_fraction: float = 0.9
    final_ratio: float = 0.1


@dataclass
class TrainerSection:
    max_steps: int = 1_000_000
    micro_batch_size: int = 32
    accumulate_grad_batches: int = 1
    devices: Any = "auto"  # "auto" or a number of devices per node
    num_nodes: int = 1
    accelerator: str = "auto"
    # Lightning names (auto, ddp, fsdp, deepspeed_stage_2, ...) or "fsdp2" (ModelParallelStrategy + fully_shard).
    strategy: str = "auto"
    precision: Optional[str] = None  # None: bf16-mixed on GPU, 32 on CPU
    gradient_clip_val: float = 1.0
    log_every_n_steps: int = 10
    val_check_interval: int = 1000  # optimizer steps between validation losses (needs data.validation_docs)
    checkpoint_every_n_steps: int = 1000
    keep_checkpoints: int = 3  # step checkpoints kept besides last.ckpt (-1 = all)
    compile: bool = False
    masked_only_logits: bool = True  # project to the vocabulary at masked positions only
    progress_bar: bool = True
    seed: int = 0


@dataclass
class PretrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    masking: MaskingSection = field(default_factory=MaskingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    run_dir: str = "runs/neobert"  # checkpoints, logs, plot and export go under it
    resume: bool = False  # continue from run_dir/checkpoints/last.ckpt
    init_from: Optional[str] = None  # weights to start from: an export directory or a Lightning .ckpt
    export_dir: Optional[str] = None  # default: run_dir/export
    glue_callback: GlueCallbackConfig = field(default_factory=GlueCallbackConfig)
    mteb_callback: MtebCallbackConfig = field(default_factory=MtebCallbackConfig)


def validate_config(config: PretrainConfig) -> None:
    """Checks the values OmegaConf's types cannot; every message names the key."""
    data, masking, opt, sched, trainer = config.data, config.masking, config.optimizer, config.scheduler, config.trainer

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"invalid config key {key!r}: {message}")

    need(masking.strategy in MASKING_STRATEGIES, "masking.strategy", f"must be one of {MASKING_STRATEGIES}")
    need(0.0 < masking.rate < 1.0, "masking.rate", f"must be in (0, 1), got {masking.rate}")
    need(masking.pad_to_multiple_of >= 1, "masking.pad_to_multiple_of", "must be >= 1")
    need(opt.name in OPTIMIZERS, "optimizer.name", f"must be one of {OPTIMIZERS}")
    need(opt.lr > 0, "optimizer.lr", "must be positive")
    need(len(opt.betas) == 2 and all(0 <= b < 1 for b in opt.betas), "optimizer.betas", "must be two values in [0, 1)")
    need(sched.name in SCHEDULERS, "scheduler.name", f"must be one of {SCHEDULERS}")
    need(sched.warmup_steps >= 0, "scheduler.warmup_steps", "must be >= 0")
    need(0 < sched.decay_fraction <= 1, "scheduler.decay_fraction", "must be in (0, 1]")
    need(0 <= sched.final_ratio <= 1, "scheduler.final_ratio", "must be in [0, 1]")
    need(data.max_length >= 8, "data.max_length", "must be at least 8")
    need(data.shuffle_buffer >= 1, "data.shuffle_buffer", "must be >= 1 (1 = no shuffling)")
    need(data.num_workers >= 0, "data.num_workers", "must be >= 0")
    need(data.validation_docs >= 0, "data.validation_docs", "must be >= 0")
    need(data.text_sample_by in ("paragraph", "line", "document"), "data.text_sample_by",
         "must be paragraph, line or document")
    need(len(data.length_buckets) == len(data.bucket_probabilities), "data.bucket_probabilities",
         f"needs one probability per entry of data.length_buckets ({len(data.length_buckets)})")
    if data.length_buckets:
        need(list(data.length_buckets) == sorted(data.length_buckets) and data.length_buckets[0] >= 0,
             "data.length_buckets", "must be non-negative and increasing, e.g. [0, 1024, 2048]")
        need(all(p >= 0 for p in data.bucket_probabilities) and abs(sum(data.bucket_probabilities) - 1) < 1e-6,
             "data.bucket_probabilities", "must be non-negative and sum to 1")
        need(data.bucket_queue_docs >= 1, "data.bucket_queue_docs", "must be >= 1")
    need(trainer.max_steps > 0, "trainer.max_steps", "must be positive")
    need(trainer.micro_batch_size > 0, "trainer.micro_batch_size", "must be positive")
    need(trainer.accumulate_grad_batches > 0, "trainer.accumulate_grad_batches", "must be positive")
    need(trainer.checkpoint_every_n_steps > 0, "trainer.checkpoint_every_n_steps", "must be positive")
    need(trainer.val_check_interval > 0, "trainer.val_check_interval", "must be positive")
    need(trainer.log_every_n_steps > 0, "trainer.log_every_n_steps", "must be positive")
    need(trainer.devices == "auto" or (isinstance(trainer.devices, int) and trainer.devices > 0)
         or (isinstance(trainer.devices, str) and trainer.devices.isdigit()),
         "trainer.devices", f"must be 'auto' or a positive integer, got {trainer.devices!r}")
    need(trainer.precision in (None, "32", "32-true", "16-mixed", "bf16-mixed", "bf16-true", "64", "64-true"),
         "trainer.precision", f"{trainer.precision!r} is not a Lightning precision")
