"""The schema of a pretraining run (`python -m experiments.pretrain --config neobert key=value ...`).

This schema is a contract: the ablation configs (M0..M10) are written over these keys. Defaults are the paper's
stage-1 recipe (NeoBERT paper, Section 3 and Table 1) except for the trainer's sizes, which `configs/neobert.yaml`
sets. `PretrainConfig.resolve` derives what other keys decide (the loader calls it once), then
`PretrainConfig.validate` checks what the types cannot, changing nothing, before any work starts.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from neobert.config.common import (LoggingConfig, OptimizerConfig, SchedulerConfig, TrainerConfig,
                                   check_optimizer_strategy)
from neobert.config.loader import require

MASKING_STRATEGIES = ("all_mask", "bert")
PACKING_MODES = ("none", "greedy", "best_fit")
# data.packing was a boolean before best-fit packing: true meant today's greedy packing.
PACKING_BOOLEANS = {"true": "greedy", "false": "none"}
STATIC_SHAPES = ("auto", "true", "false")
COMPILE_SETTINGS = ("true", "false", "auto")  # model.compile: auto is decided by the run for its device
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The compile modes that record CUDA graphs: the model's (neobert.model.kernels, which compiles), stated here for the
# schema's checks, below the model (tests/test_kernel_plan.py ties them to each other and to torch's own table)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# the strategy that copies each micro-batch's gradients out of param.grad into a buffer of its own (ZeRO-2's gradient
# hooks, with contiguous gradients; its _offload variant too), so that an accumulation never keeps them in a CUDA
# graph's memory
GRADIENT_COPYING_STRATEGY = "deepspeed_stage_2"
MAX_STREAMS = 4096  # data.streams: every stream is its own reader's state in each checkpoint


def compile_warmup_steps(compile_mode: str) -> int:
    """The untimed steps of a batch shape a compiled model needs before it is timed: a shape compiles at its first
    step, and a CUDA graph mode records its graphs at the next."""
    return 2 if compile_mode in CUDA_GRAPH_MODES else 1

# What torch.compile compiles (NeoBERTPreTrained.compile's scope): the whole forward, or each encoder block on its own
COMPILE_SCOPES = ("model", "blocks")


@dataclass
class ModelConfig:
    preset: str = "neobert"
    # Any NeoBERTConfig field, e.g. position_encoding, activation, norm, max_length, attention_backend, dropout.
    overrides: Dict[str, Any] = field(default_factory=dict)
    # torch.compile the model: true, false, or auto: compiled where the model's rule says it pays for the device the
    # run trains on (neobert.model.kernels.compile_pays: a CUDA GPU of compute capability 9.0 or later with Triton),
    # decided when the run starts (neobert.jobs.pretrain.decide_compile); false is the one switch to eager
    compile: Any = False
    # torch.compile's mode with model.compile: reduce-overhead replays each step as CUDA graphs (one launch instead of
    # hundreds; needs one batch shape, data.static_shapes), max-autotune also searches matmul kernels (slow to start).
    compile_mode: str = "default"
    # model: one graph of the whole forward. blocks: each encoder block compiled on its own, one graph they share
    # (compiles in the time of one block), and the MLM head's decoder and loss on their own unless fused_mlm_loss fuses
    # them; the embedding stays eager
    compile_scope: str = "model"
    masked_only_logits: bool = True  # project to the vocabulary at masked positions only


DEFAULT_SOURCE = "tiiuae/falcon-refinedweb"
SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a source's name is part of metric names (train/tokens/<name>)


@dataclass
class DataSourceConfig:
    """One source of a data mixture (data.sources): the fields `data.source` has, plus how often to draw it."""

    name: str = ""  # in metric names: train/tokens/<name>, train/share/<name>, val/loss/<name>
    source: str = ""  # a hub dataset name, or local files (as data.source)
    hub_config: Optional[str] = None
    split: str = "train"
    text_column: str = "content"
    text_sample_by: str = "paragraph"
    # The draw probability is proportional to weight (x size^data.mixture_temperature when that is set).
    weight: float = 1.0
    # Its size for temperature sampling, in any unit shared by the sources (tokens, documents, bytes); 0 = the
    # bytes of its local files, measured (a hub source must say its size).
    size: float = 0.0
    max_epochs: int = 0  # after this many passes the source is retired and the others renormalised; 0 = endless


@dataclass
class PretrainDataConfig:
    # A hub dataset name, or local files: a file, a directory or a glob of .txt/.jsonl/.json/.parquet/.csv.
    source: Optional[str] = DEFAULT_SOURCE  # null with data.sources
    hub_config: Optional[str] = None
    split: str = "train"
    text_column: str = "content"
    # How .txt files are cut into documents: "paragraph" (blank-line separated), "line" or "document" (a file).
    text_sample_by: str = "paragraph"
    tokenizer: str = "google-bert/bert-base-uncased"  # a hub name or a local tokenizer directory
    max_length: int = 1024
    # "none": each document truncated to max_length and padded (the paper); packed rows of max_length tokens with
    # cu_seqlens (no cross-document attention, no [PAD]): "greedy" (documents end to end, split at row ends) or
    # "best_fit" (documents kept whole, each into the open row it fits best; only longer-than-a-row ones split).
    packing: str = "none"
    packing_open_rows: int = 64  # best_fit: rows kept open to receive documents
    # Packed batches of one shape (neobert.data.masking.StaticShapes), so that a compiled model traces one graph:
    # micro_batch_size x max_length tokens, each row's [PAD] tail its own document (label -100), cu_seqlens of a
    # fixed length (zero-length documents after the real ones), max_seqlen = max_length, masked_index of a fixed
    # length. Without it every packed batch has its own shapes and torch.compile recompiles. "auto": on with
    # model.compile (resolved by PretrainConfig.resolve). Packed batches only (data.packing greedy or best_fit).
    static_shapes: str = "auto"
    # The documents a static micro-batch may hold, per row on average, [PAD] tails included (cu_seqlens has rows x
    # this + 1 entries); a batch with more stops the run with an error naming this key. 0 = max(8, max_length // 32).
    static_documents_per_row: int = 0
    # packing none: train on the batch's documents laid end to end with cu_seqlens (varlen attention, no [PAD], no
    # cross-document attention; the same documents, masks and loss as the padded batch) instead of padded: on GPU
    # FlashAttention's varlen kernel, which masked SDPA cannot use; faster on CPU too, more so with more padding
    # (docs/benchmarks.md). false = pad.
    unpad: bool = True
    # Documents are read in blocks of this many and each block is shuffled (exactly resumable); 1 = no shuffle.
    shuffle_buffer: int = 10_000
    # Stage 2: sample documents of >= length_buckets[i] tokens with probability bucket_probabilities[i].
    length_buckets: List[int] = field(default_factory=list)
    bucket_probabilities: List[float] = field(default_factory=list)
    bucket_queue_docs: int = 32  # documents held per bucket while waiting to be drawn
    pretokenized_dir: Optional[str] = None  # parquet shards written by `experiments.pretrain --pretokenize`
    num_workers: int = 2
    # Canonical streams the corpus is cut into, fixed for the run and recorded in its checkpoints: the batches of
    # every optimizer step are the same on any devices x nodes x max(1, num_workers) readers dividing it, and a
    # checkpoint resumes on any such layout (neobert.data.stream_layout). 0 = the checkpoint's, else one per reader.
    streams: int = 0
    validation_docs: int = 0  # the first N documents are held out for a validation loss (0 = none)
    validation_batches: int = 0  # cap on validation batches per check (0 = all)
    # The unigram-entropy baseline (the loss of a context-free model) over this many training documents; 0 = off.
    baseline_docs: int = 0
    seed: int = 0
    # A mixture of sources instead of data.source: each document is drawn from source i with probability
    # proportional to its weight (x its size^mixture_temperature when the temperature is > 0: mmBERT's tau).
    sources: List[DataSourceConfig] = field(default_factory=list)
    mixture_temperature: float = 0.0
    # New weights for some of data.sources, by name (a phase reweights its mixture without restating the sources).
    source_weights: Dict[str, float] = field(default_factory=dict)


@dataclass
class SourceData(PretrainDataConfig):
    """The data settings of one source of a mixture as the single-source code reads them (the run's settings with
    that source's fields); `key` is how messages name it. Built by `neobert.data.mixture`, never written."""

    key: str = "data.source"


@dataclass
class MaskingConfig:
    rate: float = 0.2  # the training rate (unless rate_schedule is set) and always the validation rate
    # A training rate that changes with the optimizer step: [[step, rate], ...], piecewise-linear between points,
    # constant before the first and after the last; repeat a step for a jump (mmBERT: 0.3 -> 0.15 -> 0.05).
    rate_schedule: List[List[float]] = field(default_factory=list)
    strategy: str = "all_mask"  # "all_mask": 100% [MASK] (NeoBERT); "bert": 80% [MASK] / 10% random / 10% kept
    pad_to_multiple_of: int = 8

    @property
    def highest_rate(self) -> float:
        """The highest rate of the run, schedule included (what a static batch's masked_index must hold)."""
        return max([self.rate] + [point[1] for point in self.rate_schedule])


@dataclass
class BatchSizeWarmupConfig:
    """The global batch grows linearly with the tokens trained, from `start_batch_size` sequences to the full
    batch (micro_batch_size x accumulation x devices) over `tokens` tokens (ModernBERT's batch-size warm-up). The
    micro-batch shrinks, the accumulation count stays. 0 = off."""

    start_batch_size: int = 0
    tokens: int = 0


@dataclass
class PretrainTrainerConfig(TrainerConfig):
    max_steps: int = 1_000_000
    micro_batch_size: int = 32  # sequences per device per forward; x accumulation x devices = the batch
    eval_every_n_steps: int = 1000  # validation loss every N optimizer steps (needs data.validation_docs)
    checkpoint_every_n_steps: int = 1000
    batch_size_warmup: BatchSizeWarmupConfig = field(default_factory=BatchSizeWarmupConfig)
    UNBOUNDED_STEPS: ClassVar[Optional[str]] = None  # the stream is endless: trainer.max_steps ends the run

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step, all devices."""
        return self.micro_batch_size * self.accumulate_grad_batches * self.num_devices * self.num_nodes

    def validate(self, prefix: str = "trainer") -> None:
        super().validate(prefix)
        warmup = self.batch_size_warmup
        require(warmup.start_batch_size >= 0 and warmup.tokens >= 0, f"{prefix}.batch_size_warmup",
                "start_batch_size and tokens must be >= 0")
        require((warmup.start_batch_size > 0) == (warmup.tokens > 0), f"{prefix}.batch_size_warmup",
                "set both start_batch_size and tokens (or neither)")
        require(warmup.start_batch_size <= self.batch_size, f"{prefix}.batch_size_warmup.start_batch_size",
                f"{warmup.start_batch_size} exceeds the full batch of {self.batch_size} sequences")

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
    task: str = "sts"  # "sts" (pairs with scores), "retrieval" (query/positive pairs) or "beir" (a BEIR directory)
    data_path: Optional[str] = None  # e.g. an STS Benchmark CSV (sts-dev.csv layout), or a BEIR directory
    max_examples: int = 500
    batch_size: int = 64
    max_length: int = 128

    def validate(self, prefix: str = "mteb_callback") -> None:
        require(self.every_n_steps >= 0, f"{prefix}.every_n_steps", "must be >= 0 (0 = off)")
        require(self.task in ("sts", "retrieval", "beir"), f"{prefix}.task", "must be 'sts', 'retrieval' or 'beir'")
        require(self.every_n_steps == 0 or bool(self.data_path), f"{prefix}.data_path",
                "the MTEB callback needs a local task file (an STS Benchmark CSV for task=sts, a query/positive "
                "jsonl for task=retrieval, a BEIR directory with a single qrels split for task=beir)")


@dataclass
class PhaseConfig:
    """One phase of a phased recipe (`phases:`): its length, and what it changes from the phase before it."""

    name: str = ""  # the export goes to output_dir/export/<name>; `--phase NAME` restarts here
    steps: Optional[int] = None  # the phase's optimizer steps (> 0); or
    tokens: Optional[int] = None  # its tokens (> 0; steps = tokens / (batch x data.max_length), rounded up).
    # Neither (left out): the last phase runs to trainer.max_steps
    # Dotted keys of this config and their values for this phase and the ones after it (until changed again), e.g.
    # {data.max_length: 4096, model.overrides.rope_theta: 160000, scheduler.phase: decay}. PHASE_KEYS lists what
    # may change: the weights and the optimizer state carry over, so the architecture and vocabulary may not.
    overrides: Dict[str, Any] = field(default_factory=dict)


# What a phase may change (prefixes of dotted keys). Not listed, and refused: the architecture (model.preset,
# hidden size, layers, ...), the tokenizer, the devices and data workers (the data positions are per stream).
PHASE_KEYS = ("data.sources", "data.source", "data.hub_config", "data.split", "data.text_column",
              "data.text_sample_by", "data.mixture_temperature",
              "data.source_weights", "data.max_length", "data.packing",
              "data.packing_open_rows", "data.static_shapes", "data.static_documents_per_row", "data.unpad",
              "data.length_buckets", "data.bucket_probabilities",
              "data.bucket_queue_docs", "data.shuffle_buffer", "data.validation_docs", "data.validation_batches",
              "masking.", "optimizer.lr", "optimizer.weight_decay", "scheduler.", "trainer.micro_batch_size",
              "trainer.accumulate_grad_batches", "trainer.eval_every_n_steps", "trainer.checkpoint_every_n_steps",
              "model.overrides.rope_theta", "model.overrides.max_length")


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
    # Continue another run's Lightning checkpoint in this output_dir: weights, optimizer, step, schedule and data
    # position (e.g. a wsd decay branch, scheduler.phase=decay, from a stable-phase checkpoint).
    branch_from: Optional[str] = None
    export_dir: Optional[str] = None  # default: output_dir/export
    glue_callback: GlueCallbackConfig = field(default_factory=GlueCallbackConfig)
    mteb_callback: MtebCallbackConfig = field(default_factory=MtebCallbackConfig)
    # Phases run in order by one command (neobert.jobs.phases), each from where the one before ended.
    phases: List[PhaseConfig] = field(default_factory=list)

    RENAMED_KEYS: ClassVar[Dict[str, str]] = {
        "run_dir": "output_dir",
        "trainer.compile": "model.compile",
        "trainer.masked_only_logits": "model.masked_only_logits",
        "trainer.progress_bar": "logging.progress_bar",
        "trainer.log_every_n_steps": "logging.log_every_n_steps",
        "trainer.val_check_interval": "trainer.eval_every_n_steps",
    }

    def resolve(self) -> None:
        """Writes into the config what other keys decide: the loader calls it once, before `validate` (and a phase's
        config is resolved again once its overrides are applied, neobert.jobs.phases.phase_config).

        * data.packing's legacy booleans become their names (true: greedy, false: none), with a warning;
        * model.compile's true, false and auto, given as strings, become True, False and "auto";
        * data.static_shapes is lower-cased, and auto becomes model.compile (true or false), or stays auto while
          model.compile is auto (the run decides both for its device: neobert.jobs.pretrain.decide_compile).

        A value that is none of these is left as given, for `validate` to name. Calling it again changes nothing."""
        data = self.data
        if str(data.packing).lower() in PACKING_BOOLEANS:
            data.packing = PACKING_BOOLEANS[str(data.packing).lower()]
            warnings.warn(f"data.packing={data.packing != 'none'} is deprecated and will be removed in the next "
                          f"release; use data.packing={data.packing}", FutureWarning, stacklevel=2)
        if str(self.model.compile).lower() in COMPILE_SETTINGS:
            self.model.compile = {"true": True, "false": False}.get(str(self.model.compile).lower(), "auto")
        static = str(data.static_shapes).lower()
        if static in STATIC_SHAPES:
            # auto follows model.compile, which no phase may change: the same whatever a phase's packing.
            follows = str(self.model.compile).lower()  # "auto" until the run decides model.compile=auto
            data.static_shapes = follows if static == "auto" and follows in COMPILE_SETTINGS else static

    def derived_model_overrides(self) -> Dict[str, Any]:
        """The NeoBERTConfig fields the data decides where model.overrides leaves them unset: attention_backend=varlen
        when training batches carry cu_seqlens (data.packing or data.unpad), so the export unpads padded batches too.
        Derived when the model config is built, never written into model.overrides (checkpoints record the config as
        given; each phase derives its own)."""
        if "attention_backend" in self.model.overrides or (self.data.packing == "none" and not self.data.unpad):
            return {}
        return {"attention_backend": "varlen"}

    def validate(self) -> None:
        """Checks the values the types cannot, changing nothing; every message names the key."""
        data, masking = self.data, self.masking
        for section in (self.optimizer, self.scheduler, self.trainer, self.logging, self.glue_callback,
                        self.mteb_callback):
            section.validate()
        check_optimizer_strategy(self.optimizer, self.trainer)
        require(masking.strategy in MASKING_STRATEGIES, "masking.strategy", f"must be one of {MASKING_STRATEGIES}")
        require(0.0 < masking.rate < 1.0, "masking.rate", f"must be in (0, 1), got {masking.rate}")
        points = masking.rate_schedule
        require(all(len(p) == 2 and p[0] >= 0 and 0 < p[1] < 1 for p in points), "masking.rate_schedule",
                "must be [[step, rate], ...] with steps >= 0 and rates in (0, 1)")
        require([p[0] for p in points] == sorted(p[0] for p in points), "masking.rate_schedule",
                "steps must be non-decreasing")
        require(not (self.init_from and self.branch_from), "branch_from",
                "init_from (weights only) and branch_from (a whole training state) exclude each other")
        require(self.scheduler.phase != "decay" or self.scheduler.decay_steps is None, "scheduler.decay_steps",
                "is set by the run in phase=decay (from its first step to trainer.max_steps): leave it null")
        require(data.packing in PACKING_MODES, "data.packing", f"must be one of {PACKING_MODES}")
        require(data.packing_open_rows >= 1, "data.packing_open_rows", "must be >= 1")
        require(isinstance(data.unpad, bool), "data.unpad", f"must be true or false, got {data.unpad!r}")
        require(str(data.static_shapes).lower() in STATIC_SHAPES, "data.static_shapes",
                f"must be one of {STATIC_SHAPES}, got {data.static_shapes!r}")
        model = self.model
        # Under model.compile=true, true is also what auto became (resolve; a phase inherits it whatever its
        # packing), so only a true that auto could not have given is refused.
        require(str(data.static_shapes).lower() != "true" or data.packing != "none" or model.compile is True,
                "data.static_shapes", "true lays out packed batches in one shape, and data.packing=none packs none: "
                "set data.packing to greedy or best_fit, or data.static_shapes to auto or false")
        require(isinstance(model.compile, bool) or model.compile == "auto", "model.compile",
                f"must be true, false or auto, got {model.compile!r}")
        may_compile = model.compile in (True, "auto")  # the mode and scope apply where auto decides to compile
        require(model.compile_mode in COMPILE_MODES, "model.compile_mode",
                f"must be one of {COMPILE_MODES}, got {model.compile_mode!r}")
        require(may_compile or model.compile_mode == "default", "model.compile_mode",
                f"{model.compile_mode!r} is a mode of torch.compile: set model.compile=true (or auto) too")
        require(model.compile_scope in COMPILE_SCOPES, "model.compile_scope",
                f"must be one of {COMPILE_SCOPES}, got {model.compile_scope!r}")
        require(may_compile or model.compile_scope == "model", "model.compile_scope",
                "chooses what torch.compile compiles: set model.compile=true (or auto) too")
        # A CUDA graph replays fixed shapes: a batch of new shape records another graph (memory and time)
        require(model.compile_mode not in CUDA_GRAPH_MODES or str(data.static_shapes).lower() != "false"
                and data.packing != "none", "model.compile_mode",
                f"{model.compile_mode!r} records CUDA graphs, which need batches of one shape: packed batches "
                "(data.packing=greedy or best_fit) with data.static_shapes true or auto")
        # Inductor's CUDA graph trees hand a step's gradients out in their memory pool, which the next replay reuses:
        # kept across micro-batches, a gradient is overwritten under the accumulation (wrong, or an error:
        # pytorch/pytorch#96693, #169545). DeepSpeed ZeRO-2 with contiguous gradients copies each micro-batch's
        # gradients into its own buffer in its hooks (0.19.8, stage_1_and_2.py:1452-1461); ZeRO-1, or ZeRO-2 without
        # contiguous gradients, keeps them in param.grad until the accumulation's last micro-batch (a CPU
        # simulation of a replayed gradient buffer: ZeRO-2 as the recipe builds it summed right, those two did not).
        trainer = self.trainer
        copies_gradients_out = (trainer.strategy.startswith(GRADIENT_COPYING_STRATEGY)
                                and trainer.deepspeed.contiguous_gradients is not False)
        require(model.compile_mode not in CUDA_GRAPH_MODES or trainer.accumulate_grad_batches == 1
                or copies_gradients_out, "model.compile_mode",
                f"{model.compile_mode!r} replays CUDA graphs whose output memory the next micro-batch reuses, and "
                f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} under trainer.strategy="
                f"{trainer.strategy}"
                f"{' without contiguous gradients' * trainer.strategy.startswith(GRADIENT_COPYING_STRATEGY)} "
                f"would keep the accumulating gradients in it (wrong, or an error): use trainer.strategy="
                f"deepspeed_stage_2 (the recipe's; with trainer.deepspeed.contiguous_gradients left on, it copies "
                f"each micro-batch's gradients out), trainer.accumulate_grad_batches=1, or model.compile_mode=default")
        require(0 <= data.static_documents_per_row <= data.max_length, "data.static_documents_per_row",
                f"must be 0 (max(8, data.max_length // 32)) to data.max_length={data.max_length} (a row of "
                f"{data.max_length} tokens holds no more documents than tokens), got {data.static_documents_per_row}")
        require(masking.pad_to_multiple_of >= 1, "masking.pad_to_multiple_of", "must be >= 1")
        require(data.max_length >= 8, "data.max_length", "must be at least 8")
        require(data.shuffle_buffer >= 1, "data.shuffle_buffer", "must be >= 1 (1 = no shuffling)")
        require(data.num_workers >= 0, "data.num_workers", "must be >= 0")
        require(0 <= data.streams <= MAX_STREAMS, "data.streams",
                f"must be 0 (one per reader) to {MAX_STREAMS:,} (each stream reads its own share of the corpus)")
        require(data.validation_docs >= 0, "data.validation_docs", "must be >= 0")
        require(data.text_sample_by in ("paragraph", "line", "document"), "data.text_sample_by",
                "must be paragraph, line or document")
        self._validate_sources(data)
        require(len(data.length_buckets) == len(data.bucket_probabilities), "data.bucket_probabilities",
                f"needs one probability per entry of data.length_buckets ({len(data.length_buckets)})")
        if data.length_buckets:
            require(list(data.length_buckets) == sorted(data.length_buckets) and data.length_buckets[0] >= 0,
                    "data.length_buckets", "must be non-negative and increasing, e.g. [0, 1024, 2048]")
            require(all(p >= 0 for p in data.bucket_probabilities)
                    and abs(sum(data.bucket_probabilities) - 1) < 1e-6,
                    "data.bucket_probabilities", "must be non-negative and sum to 1")
            require(data.bucket_queue_docs >= 1, "data.bucket_queue_docs", "must be >= 1")

    @staticmethod
    def _validate_sources(data: PretrainDataConfig) -> None:
        require(0 <= data.mixture_temperature < math.inf, "data.mixture_temperature",
                f"must be a finite number >= 0 (0 = the weights alone), got {data.mixture_temperature}")
        if not data.sources:
            require(bool(data.source), "data.source", "must name a hub dataset or local files (or set data.sources)")
            require(not data.source_weights, "data.source_weights",
                    "weighs the sources of data.sources: there are none")
            return
        require(data.source in (None, DEFAULT_SOURCE), "data.sources",
                f"replaces data.source: set one or the other (data.source={data.source!r} is set too: data.source=null "
                f"clears it)")
        require(not data.pretokenized_dir, "data.pretokenized_dir", "is for one source: leave it unset with "
                "data.sources (each source is read and tokenized as it streams)")
        names = [s.name for s in data.sources]
        for i, s in enumerate(data.sources):
            key = f"data.sources[{i}]"
            require(bool(SOURCE_NAME.fullmatch(s.name or "")), f"{key}.name",
                    f"must be a non-empty name of letters, digits, '_', '.' or '-' (it names metrics), got {s.name!r}")
            require(s.name not in names[:i], f"{key}.name", f"{s.name!r} names two sources")
            require(bool(s.source), f"{key}.source", "must name a hub dataset or local files")
            require(s.weight >= 0, f"{key}.weight", f"must be >= 0, got {s.weight}")
            require(s.size >= 0, f"{key}.size", f"must be >= 0 (0 = measured), got {s.size}")
            require(s.max_epochs >= 0, f"{key}.max_epochs", f"must be >= 0 (0 = endless), got {s.max_epochs}")
            require(s.text_sample_by in ("paragraph", "line", "document"), f"{key}.text_sample_by",
                    "must be paragraph, line or document")
        for name, weight in data.source_weights.items():
            require(name in names, f"data.source_weights.{name}", f"is not a source of data.sources: {names}")
            require(weight >= 0, f"data.source_weights.{name}", f"must be >= 0, got {weight}")
        require(any(data.source_weights.get(s.name, s.weight) > 0 for s in data.sources), "data.sources",
                "every weight is 0: nothing can be drawn")
