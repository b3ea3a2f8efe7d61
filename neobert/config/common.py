"""The sections every training job shares: `trainer`, `optimizer`, `scheduler` and `logging`.

Each job's schema holds these under the same keys with the same meaning (a job may add fields in a subclass, or
change a default); `neobert.lit.trainer.build_trainer` and `neobert.lit.optim` are the only code that reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional

from neobert.config.loader import require

PRECISIONS = ("32", "32-true", "16-mixed", "bf16-mixed", "bf16-true", "64", "64-true")
PROFILERS = ("simple", "advanced", "pytorch")
OPTIMIZERS = ("adamw", "adam", "stable_adamw", "muon")
SCHEDULERS = ("cosine", "linear", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
# wsd: "full" (warm-up, stable, decay ending at max_steps), "stable" (no decay: a run to extend or branch later),
# "decay" (the decay starts where this run starts: a branch from a stable-phase checkpoint, see branch_from).
PHASES = ("full", "stable", "decay")
LOGGERS = ("csv", "tensorboard")
OPTIMIZER_KEYS = ("lr", "weight_decay", "betas", "eps")
# Where the fine-tuning jobs kept their logging settings before the shared `logging` section.
LOGGING_KEYS_MOVED = {"trainer.enable_progress_bar": "logging.progress_bar",
                      "trainer.log_every_n_steps": "logging.log_every_n_steps"}
# `model_overrides` of a job that loads a trained model (GLUE, NER, contrastive, mining, MTEB): the NeoBERTConfig
# fields it may change at load, those that leave what the weights compute as it is (which kernels run the MLP and
# norms, docs/pretraining.md "The model's kernels").
LOAD_TIME_FIELDS = ("kernels",)
# Where those jobs kept the kernels before `model_overrides`.
KERNELS_MOVED = {"kernels": "model_overrides.kernels"}


def check_load_time_overrides(model_overrides: dict[str, Any]) -> None:
    """Every field of a trained model's `model_overrides` is one of LOAD_TIME_FIELDS."""
    for name in model_overrides:
        require(name in LOAD_TIME_FIELDS, f"model_overrides.{name}",
                f"not a NeoBERTConfig field a loaded model may change; the fields: {', '.join(LOAD_TIME_FIELDS)}")


@dataclass
class EmaConfig:
    """An exponential moving average of the weights (neobert.lit.ema), updated every `every_n_steps` optimizer
    steps as ema = decay x ema + (1 - decay) x weights; kept in every checkpoint, validated as val/loss_ema,
    exported beside the raw weights (pretraining: export/ema). decay 0 = off."""

    decay: float = 0.0
    every_n_steps: int = 1

    def validate(self, prefix: str = "trainer.ema") -> None:
        require(0 <= self.decay < 1, f"{prefix}.decay", "must be in [0, 1) (0 = off)")
        require(self.every_n_steps >= 1, f"{prefix}.every_n_steps", "must be >= 1")


@dataclass
class DeepSpeedConfig:
    """What DeepSpeed offers to tune, for the DeepSpeed strategies (trainer.strategy=deepspeed_stage_1/2/3...).
    null = Lightning's default for that strategy (lightning 2.6.6 strategies/deepspeed.py: buckets of 2e8 elements,
    overlap_comm and contiguous_gradients on). `python -m experiments.pretrain --preflight` prints the rendered
    DeepSpeed config."""

    # bf16: DeepSpeed 0.19.8 checks every step for inf/NaN gradients and skips the step if any (its bf16 default,
    # kept from fp16's loss scaling), reading the flag on the host: a device sync per optimizer step
    # (runtime/zero/stage_1_and_2.py:3237-3249, `overflow_gpu[0].item()`). bf16 has float32's exponent range, and
    # pretraining watches the loss without a host read (NonFiniteLossError), so the check is off by default.
    check_grad_overflow: bool = False
    reduce_bucket_size: Optional[int] = None  # elements per gradient reduction bucket
    allgather_bucket_size: Optional[int] = None  # elements per parameter all-gather bucket
    overlap_comm: Optional[bool] = None  # overlap the gradient reduction with the backward
    contiguous_gradients: Optional[bool] = None  # copy gradients into one buffer as they are produced

    def validate(self, prefix: str = "trainer.deepspeed") -> None:
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            value = getattr(self, key)
            require(value is None or value > 0, f"{prefix}.{key}", f"must be positive or null, got {value}")

    def strategy_settings(self) -> dict[str, Any]:
        """The settings given, as Lightning's DeepSpeedStrategy takes them."""
        keys = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients")
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}


@dataclass
class TrainerConfig:
    """Lightning's Trainer settings (neobert.lit.trainer.build_trainer)."""

    accelerator: str = "auto"
    devices: Any = "auto"  # "auto" or a number of devices per node
    num_nodes: int = 1
    # Lightning names (auto, ddp, fsdp, deepspeed_stage_2, ...) or "fsdp2" (ModelParallelStrategy + fully_shard).
    strategy: str = "auto"
    precision: Optional[str] = None  # None: bf16-mixed on GPU, 32-true on CPU
    max_steps: int = -1  # optimizer steps; -1 = bounded by max_epochs
    max_epochs: Optional[int] = None  # None = bounded by max_steps
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0  # gradient-norm clipping; 0 = off
    eval_every_n_steps: int = 0  # optimizer steps between validations; 0 = no validation during training
    # output_dir/checkpoints/step-N.ckpt every N optimizer steps, plus last.ckpt (what resume=true continues from);
    # 0 = none. The newest keep_checkpoints step checkpoints are kept (-1 = all).
    checkpoint_every_n_steps: int = 0
    keep_checkpoints: int = 3
    seed: int = 0
    ema: EmaConfig = field(default_factory=EmaConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    # Where the time of each step goes (data loading, forward/backward, optimizer, logging, callbacks): Lightning's
    # simple | advanced (cProfile) | pytorch profiler, reported in output_dir/profile*.txt when the run ends.
    profiler: Optional[str] = None
    # What a max_steps of -1 means for the job, or None where the job needs a step count (pretraining: endless data).
    UNBOUNDED_STEPS: ClassVar[Optional[str]] = "bounded by max_epochs"

    def validate(self, prefix: str = "trainer") -> None:
        devices = self.devices
        require(devices == "auto" or (isinstance(devices, int) and devices > 0)
                or (isinstance(devices, str) and devices.isdigit() and int(devices) > 0),
                f"{prefix}.devices", f"must be 'auto' or a positive integer, got {devices!r}")
        require(self.num_nodes >= 1, f"{prefix}.num_nodes", "must be >= 1")
        require(self.precision is None or str(self.precision) in PRECISIONS, f"{prefix}.precision",
                f"{self.precision!r} is not a Lightning precision ({', '.join(PRECISIONS)})")
        if self.UNBOUNDED_STEPS is None:
            require(self.max_steps > 0, f"{prefix}.max_steps", f"must be positive, got {self.max_steps}")
        else:
            require(self.max_steps == -1 or self.max_steps > 0, f"{prefix}.max_steps",
                    f"must be positive, or -1 ({self.UNBOUNDED_STEPS}), got {self.max_steps}")
        require(self.max_epochs is None or self.max_epochs == -1 or self.max_epochs > 0, f"{prefix}.max_epochs",
                "must be positive, -1 or null")
        require(self.accumulate_grad_batches > 0, f"{prefix}.accumulate_grad_batches", "must be positive")
        require(self.gradient_clip_val >= 0, f"{prefix}.gradient_clip_val", "must be >= 0 (0 = off)")
        require(self.eval_every_n_steps >= 0, f"{prefix}.eval_every_n_steps", "must be >= 0 (0 = off)")
        require(self.checkpoint_every_n_steps >= 0, f"{prefix}.checkpoint_every_n_steps", "must be >= 0 (0 = off)")
        require(self.keep_checkpoints >= -1, f"{prefix}.keep_checkpoints", "must be >= -1 (-1 = all)")
        require(self.profiler is None or self.profiler in PROFILERS, f"{prefix}.profiler",
                f"must be one of {PROFILERS} or null, got {self.profiler!r}")
        self.ema.validate(f"{prefix}.ema")
        self.deepspeed.validate(f"{prefix}.deepspeed")
        # The EMA keeps a full copy of the weights on every rank, which sharded weights do not give it.
        require(not self.ema.decay or not ("fsdp" in self.strategy or self.strategy.endswith("_3")),
                f"{prefix}.ema", f"needs the whole weights on every rank; trainer.strategy={self.strategy} shards them")

    @property
    def num_devices(self) -> int:
        """Devices per node as a number (1 for "auto": only an explicit count launches several processes)."""
        return int(self.devices) if str(self.devices).isdigit() else 1


@dataclass
class OptimizerConfig:
    # "adamw" | "adam" (coupled L2 decay, the M0 baseline) | "stable_adamw" (torch-optimi's StableAdamW: AdamW with
    # Adafactor-style update clipping; ModernBERT, Ettin) | "muon" (torch.optim.Muon on the hidden 2-D matrices,
    # AdamW on embeddings, heads, norms and biases: neobert.lit.optim.muon_split)
    name: str = "adamw"
    lr: float = 6e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_biases_embeddings: bool = False  # weight decay on matrices only, unless this is set
    # muon: the Muon group's lr and weight decay (null: optimizer.lr and optimizer.weight_decay; Muon's update is
    # scaled to AdamW's RMS, so the AdamW lr carries over) and momentum (Nesterov)
    muon_lr: Optional[float] = None
    muon_weight_decay: Optional[float] = None
    muon_momentum: float = 0.95

    def validate(self, prefix: str = "optimizer") -> None:
        require(self.name in OPTIMIZERS, f"{prefix}.name", f"must be one of {OPTIMIZERS}")
        require(self.muon_lr is None or self.muon_lr > 0, f"{prefix}.muon_lr", "must be positive or null")
        require(self.muon_weight_decay is None or self.muon_weight_decay >= 0, f"{prefix}.muon_weight_decay",
                "must be >= 0 or null")
        require(0 <= self.muon_momentum < 1, f"{prefix}.muon_momentum", "must be in [0, 1)")
        require(self.lr > 0, f"{prefix}.lr", "must be positive")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{prefix}.betas",
                "must be two values in [0, 1)")
        require(self.eps > 0, f"{prefix}.eps", "must be positive")
        require(self.weight_decay >= 0, f"{prefix}.weight_decay", "must be >= 0")


@dataclass
class SchedulerConfig:
    """Linear warm-up, then one of
    * `cosine`: down to final_ratio x the peak at decay_fraction of the run, constant after (the paper's pretraining);
    * `linear`: down to 0 at the end (fine-tuning);
    * `wsd` (warmup-stable-decay, "trapezoidal"): constant at the peak, then a decay of `decay_steps` (or
      decay_phase_fraction of the run) ending at the last step, shaped `decay_shape`, down to final_ratio x the
      peak. A stable phase can be extended, and branched into a decay from any of its checkpoints (`phase`)."""

    name: str = "cosine"
    warmup_steps: int = 2000
    warmup_fraction: Optional[float] = None  # a fraction of the run's steps; when set, it replaces warmup_steps
    decay_fraction: float = 0.9  # cosine only
    final_ratio: float = 0.1  # cosine and wsd
    decay_steps: Optional[int] = None  # wsd: steps of the decay phase; when set, it replaces decay_phase_fraction
    decay_phase_fraction: float = 0.2  # wsd: the last fraction of the run that decays
    decay_shape: str = "1-sqrt"  # wsd: linear | cosine | 1-sqrt
    phase: str = "full"  # wsd: full | stable | decay (PHASES)

    def validate(self, prefix: str = "scheduler") -> None:
        require(self.name in SCHEDULERS, f"{prefix}.name", f"must be one of {SCHEDULERS}")
        require(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
        require(self.warmup_fraction is None or 0 <= self.warmup_fraction < 1, f"{prefix}.warmup_fraction",
                "must be in [0, 1) or null")
        require(0 < self.decay_fraction <= 1, f"{prefix}.decay_fraction", "must be in (0, 1]")
        require(0 <= self.final_ratio <= 1, f"{prefix}.final_ratio", "must be in [0, 1]")
        require(self.decay_steps is None or self.decay_steps > 0, f"{prefix}.decay_steps", "must be positive or null")
        require(0 < self.decay_phase_fraction <= 1, f"{prefix}.decay_phase_fraction", "must be in (0, 1]")
        require(self.decay_shape in DECAY_SHAPES, f"{prefix}.decay_shape", f"must be one of {DECAY_SHAPES}")
        require(self.phase in PHASES, f"{prefix}.phase", f"must be one of {PHASES}")
        require(self.phase == "full" or self.name == "wsd", f"{prefix}.phase",
                f"{self.phase!r} needs scheduler.name=wsd (cosine and linear have no stable phase)")

    def warmup(self, total_steps: int) -> int:
        return int(self.warmup_fraction * total_steps) if self.warmup_fraction is not None else self.warmup_steps

    def decay_start(self, total_steps: int, start_step: int = 0) -> float:
        """wsd: the step where the decay begins (infinity in the stable phase). In the decay phase it is the
        run's first step (`start_step`, the step of the checkpoint it branches from)."""
        if self.phase == "stable":
            return math.inf
        if self.phase == "decay":
            return max(self.warmup(total_steps), start_step)
        length = self.decay_steps if self.decay_steps is not None else round(self.decay_phase_fraction * total_steps)
        return max(self.warmup(total_steps), total_steps - length)


@dataclass
class LoggingConfig:
    log_every_n_steps: int = 10
    progress_bar: bool = True
    # Metrics files under output_dir: "csv" (logs/version_N/metrics.csv), "tensorboard" (tensorboard/version_N).
    loggers: List[str] = field(default_factory=lambda: ["csv", "tensorboard"])

    def validate(self, prefix: str = "logging") -> None:
        require(self.log_every_n_steps > 0, f"{prefix}.log_every_n_steps", "must be positive")
        unknown = sorted(set(self.loggers) - set(LOGGERS))
        require(not unknown, f"{prefix}.loggers", f"unknown {unknown}; known: {list(LOGGERS)}")


@dataclass
class FineTuneDataConfig:
    """The data section every supervised fine-tuning job shares (GLUE, NER); a job changes defaults or adds keys."""

    path: Optional[str] = None  # local files; None = the task's hub data set (needs the hub)
    max_length: int = 512  # tokens per example, clipped to what the tokenizer/model accepts
    batch_size: int = 32
    eval_batch_size: int = 64
    # false: random batches, as the Hugging Face Trainer draws them by default. true: its `group_by_length`
    # (neobert.data.finetune.LengthGroupedSampler): batches of similar lengths from shuffled mega-batches, ~1.6x
    # faster on CPU (less padding) but it changes what a batch holds: WNUT-17 dev F1 3 points lower (docs/ner.md).
    group_by_length: bool = False
    num_workers: int = 0
    max_train_examples: int = 0  # 0 = all; otherwise a seeded random subset (quick runs)
    max_eval_examples: int = 0  # 0 = all; otherwise the first N of each validation split

    def validate(self, prefix: str = "data") -> None:
        require(self.max_length >= 8, f"{prefix}.max_length", "must be at least 8")
        require(self.batch_size > 0, f"{prefix}.batch_size", "must be positive")
        require(self.eval_batch_size > 0, f"{prefix}.eval_batch_size", "must be positive")
        require(self.num_workers >= 0, f"{prefix}.num_workers", "must be >= 0")
        require(self.max_train_examples >= 0, f"{prefix}.max_train_examples", "must be >= 0 (0 = all)")
        require(self.max_eval_examples >= 0, f"{prefix}.max_eval_examples", "must be >= 0 (0 = all)")


@dataclass
class FineTuneTrainerConfig(TrainerConfig):
    """The trainer section of the fine-tuning jobs (GLUE, NER): epochs with validation every n steps, early
    stopping, the best checkpoint kept."""

    devices: Any = 1
    max_epochs: Optional[int] = 10  # the paper: 10 epochs, evaluate every n steps, keep the best
    eval_every_n_steps: int = 500  # validation every n training steps, across epochs
    precision: Optional[str] = "32-true"  # "bf16-mixed" on GPUs; null = bf16-mixed on GPU, 32-true on CPU
    early_stopping_patience: int = 5  # evaluations without improvement before stopping; 0 = off

    def validate(self, prefix: str = "trainer") -> None:
        super().validate(prefix)
        require(self.max_epochs is not None and self.max_epochs > 0, f"{prefix}.max_epochs",
                "must be positive (trainer.max_steps may cap the run further)")
        require(self.eval_every_n_steps > 0, f"{prefix}.eval_every_n_steps",
                "must be positive: validation picks the best checkpoint")
        require(self.early_stopping_patience >= 0, f"{prefix}.early_stopping_patience", "must be >= 0 (0 = off)")
        require(self.checkpoint_every_n_steps == 0, f"{prefix}.checkpoint_every_n_steps",
                "is not used by fine-tuning (GLUE, NER), which keeps each run's best checkpoint "
                "(trainer.eval_every_n_steps)")
        require(not self.ema.decay, f"{prefix}.ema", "is supported by pretraining only (experiments.pretrain)")


@dataclass
class SweepConfig:
    """The paper's fine-tuning grid (GLUE, NER: `--sweep`). Every (batch size, lr, weight decay) runs once per
    seed; the median over seeds ranks it."""

    batch_sizes: List[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])
    lrs: List[float] = field(default_factory=lambda: [5e-6, 6e-6, 8e-6, 1e-5, 2e-5, 3e-5])
    weight_decays: List[float] = field(default_factory=lambda: [1e-2, 1e-5])
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])

    def validate(self, prefix: str = "sweep") -> None:
        for name in ("batch_sizes", "lrs", "weight_decays", "seeds"):
            require(len(getattr(self, name)) > 0, f"{prefix}.{name}", "must list at least one value")
        require(all(b > 0 for b in self.batch_sizes), f"{prefix}.batch_sizes", "must be positive")
        require(all(lr > 0 for lr in self.lrs), f"{prefix}.lrs", "must be positive")
        require(all(wd >= 0 for wd in self.weight_decays), f"{prefix}.weight_decays", "must be >= 0")


def check_optimizer_strategy(optimizer: OptimizerConfig, trainer: TrainerConfig) -> None:
    """Muon orthogonalises each hidden matrix whole: a strategy that shards parameters (DeepSpeed ZeRO, FSDP,
    fsdp2) would hand it slices. Refused before any work, naming both keys."""
    sharded = trainer.strategy.startswith("deepspeed") or "fsdp" in trainer.strategy
    require(not (optimizer.name == "muon" and sharded), "optimizer.name",
            f"muon needs every hidden matrix whole on each rank, and trainer.strategy={trainer.strategy} shards the "
            f"parameters: use trainer.strategy=ddp (or auto), or optimizer.name=adamw/stable_adamw")

