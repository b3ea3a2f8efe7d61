"""The schema of a throughput measurement (`python -m experiments.throughput key=value ...`; paper Figure 3 and
Table 9, docs/ablations.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from neobert.config.loader import require
from neobert.config.pretrain import COMPILE_MODES, compile_warmup_steps

# neobert-liger: the row of our encoder with model_overrides.kernels=liger (CUDA with liger-kernel installed; else a
# row saying why)
DEFAULT_MODELS = ("neobert", "neobert-liger", "neobert-official", "bert-base", "roberta-base", "modernbert-base")
# neobert-<kernels>: the name of the row of our encoder with model_overrides.kernels=<kernels> (neobert-quack: QuACK's
# MLP; CUDA with quack-kernels installed); neobert-liger is a default row too
KERNEL_MODELS = ("neobert-liger", "neobert-quack")
# neobert-<kernel>: our encoder with NeoBERTConfig.attention_kernel=<kernel> (neobert.model.attention), full rows (one
# document each) and unpadded documents through that kernel, beside neobert's auto; on CUDA where its package is
# installed (else a row saying why; padded batches run SDPA whatever the kernel: a row saying so)
ATTENTION_KERNEL_MODELS = ("neobert-flash_attn_4", "neobert-flash_attn_3", "neobert-flash_attn", "neobert-varlen_attn",
                           "neobert-xformers", "neobert-padded_sdpa")
# ModernBERT-base at transformers' attention implementations that skip the blocks outside the sliding window of its
# local layers (2 of every 3), which SDPA computes and masks: Figure 3 at ModernBERT's best installable kernels.
# modernbert-base-flex: FlexAttention (PyTorch's, compiled; its block mask), on any machine;
# modernbert-base-fa4: FlashAttention 4 (the flash-attn-4 package; Hopper and Blackwell GPUs), with FA4's local window.
WINDOWED_MODELS = {"modernbert-base-flex": "flex_attention", "modernbert-base-fa4": "flash_attention_4"}
FLEX_MODELS = tuple(name for name, attention in WINDOWED_MODELS.items() if attention == "flex_attention")
MODEL_NAMES = tuple(dict.fromkeys(DEFAULT_MODELS + KERNEL_MODELS + ATTENTION_KERNEL_MODELS + tuple(WINDOWED_MODELS)))
LAYOUTS = ("full", "padded", "unpadded")
MODES = ("inference", "training")
DTYPES = ("auto", "float32", "bfloat16")
LENGTH_DISTRIBUTIONS = ("uniform", "lognormal")


@dataclass
class ThroughputConfig:
    """Empty lists take device-dependent defaults."""

    models: List[str] = field(default_factory=lambda: list(DEFAULT_MODELS))  # any of MODEL_NAMES
    lengths: List[int] = field(default_factory=list)  # CPU: 128, 512; GPU: 128 ... 4096
    # full: every row `length` real tokens. padded / unpadded: variable-length documents (length_distribution,
    # capped at `length`), padded to the batch's longest (sdpa) or laid end to end (varlen); tokens/s counts
    # real tokens only.
    layouts: List[str] = field(default_factory=lambda: ["full"])
    length_distribution: str = "uniform"  # uniform in [length/8, length] | lognormal (median length/4, sigma 0.7)
    mode: str = "inference"  # inference | training (forward + backward, no optimizer update)
    batch_sizes: List[int] = field(default_factory=list)  # candidates; default powers of two 1 ... 1024
    max_tokens: int = 4096  # CPU memory budget per batch (batch x length); ignored on GPU (OOM probing instead)
    search_top: int = 3  # how many of the largest fitting batch sizes are timed to pick the fastest
    repeats: int = 3  # interleaved timed repetitions per model; the median is reported
    warmup: int = 1
    neobert_preset: str = "neobert"
    # NeoBERTConfig fields of the encoder for every NeoBERT row but neobert-official, e.g. {kernels: quack,
    # attention_kernel: flash_attn_4}: combinations of the machine's choices (a neobert-<kernel> row's own attention
    # kernel, and neobert-liger's and neobert-quack's kernels, win over these); the rows' notes list them. The MLM
    # head's fields are refused: the job times the encoder alone (randomly initialised: any other field is taken)
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    official_code_dir: Optional[str] = None  # a local copy of the hub repo chandar-lab/NeoBERT (model.py + config)
    device: str = "auto"  # auto | cpu | cuda
    # Inference: the weights in this dtype. Training: float32 weights under autocast to it (bf16-mixed).
    # auto = bfloat16 on GPU, float32 on CPU (bfloat16 is faster on CPUs with avx512_bf16, emulated and far slower
    # without: a warning says which).
    dtype: str = "auto"
    # For MFU. Default: the GPU's published dense bf16 peak (neobert.eval.flops.peak_flops); on CPU, the rate of one
    # 4096x768 @ 768x3072 matmul in the run's compute dtype, measured between the timed steps (not where bf16 is
    # emulated: that rate means nothing).
    peak_flops: Optional[float] = None
    matmul_calls: int = 20  # timed matmuls of that reference after every repetition of the models (the median of all)
    compile: bool = False  # torch.compile every model first (compilation is not timed)
    # With compile=true, the rows that stay eager: a reference at its best, side by side with compiled rows in one
    # run (bert-base runs slower compiled than eager: Inductor lowers its masked SDPA to float32 GEMMs)
    eager_models: List[str] = field(default_factory=list)
    # torch.compile's mode (model.compile_mode's choices): reduce-overhead replays each shape's CUDA graphs (no launch
    # per kernel); max-autotune-no-cudagraphs searches matmul tiles (minutes per shape); both compilation, not timed
    compile_mode: str = "default"
    # One more step of every timed row under torch.profiler, once every row is timed: its kernels' (GPU) or operators'
    # (CPU) self time by kind (matmul, attention, norm, elementwise, ...) per TFLOP of the model's work, so that two
    # models' categories compare; throughput_profile.csv, throughput_profile_names.csv, throughput.md, and each step's
    # Chrome trace in throughput_traces/
    profile: bool = False
    threads: int = 0  # torch CPU threads; 0 = leave as is
    seed: int = 0
    output_dir: str = "runs/throughput"

    RENAMED_KEYS: ClassVar[Dict[str, str]] = {"neobert_overrides": "model_overrides"}

    def compiles(self, model: str) -> bool:
        """Whether this run compiles the row of `model` (compile=true, and not one of eager_models)."""
        return self.compile and model not in self.eager_models

    def validate(self) -> None:
        unknown = sorted(set(self.models) - set(MODEL_NAMES))
        require(not unknown, "models", f"unknown {unknown}; known: {list(MODEL_NAMES)}")
        bad = sorted(set(self.layouts) - set(LAYOUTS))
        require(not bad, "layouts", f"unknown {bad}; known: {list(LAYOUTS)}")
        require(self.mode in MODES, "mode", f"must be one of {MODES}, got {self.mode!r}")
        require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        require(self.length_distribution in LENGTH_DISTRIBUTIONS, "length_distribution",
                f"must be one of {LENGTH_DISTRIBUTIONS}, got {self.length_distribution!r}")
        require(all(n > 0 for n in self.lengths), "lengths", "must be positive integers")
        require(all(b > 0 for b in self.batch_sizes), "batch_sizes", "must be positive integers")
        require(self.repeats >= 1, "repeats", "must be at least 1")
        require(self.search_top >= 1, "search_top", "must be at least 1")
        require(self.matmul_calls >= 1, "matmul_calls", "must be at least 1")
        require(self.compile_mode in COMPILE_MODES, "compile_mode", f"must be one of {COMPILE_MODES}, got "
                f"{self.compile_mode!r}")
        require(self.compile or self.compile_mode == "default", "compile_mode",
                f"{self.compile_mode!r} is a mode of torch.compile: set compile=true too")
        require(self.warmup >= 0, "warmup", f"must be 0 or more untimed steps, got {self.warmup}")
        strays = [name for name in self.eager_models if name not in self.models]
        require(not strays, "eager_models", f"{strays} not in models {list(self.models)}")
        require(self.compile or not self.eager_models, "eager_models",
                "names the rows that stay eager when the others are compiled: set compile=true too")
        require(not self.compile or any(map(self.compiles, self.models)), "eager_models",
                "names every model, so compile=true compiles none: leave one out, or set compile=false")
        if self.compile:
            untimed = compile_warmup_steps(self.compile_mode)
            require(self.warmup >= untimed, "warmup", f"compile=true with compile_mode={self.compile_mode} needs "
                    f"{untimed} untimed step(s) of each batch, or compilation is timed; got {self.warmup}")
