"""The typed model configuration, its named presets and the mapping to the hub's `config.json`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from neobert.errors import ConfigError
from neobert.model.attention import ATTENTION_KERNELS, attention_kernel_missing_reason
from neobert.model.kernels import liger_missing_reason, quack_missing_reason

POSITION_ENCODINGS = ("rope", "learned")
ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
ATTENTION_BACKENDS = ("sdpa", "varlen")
KERNELS = ("eager", "liger", "quack")  # neobert.model.kernels
# The fields that are choices of the machine, not of the model: never written to config.json (chosen at load).
MACHINE_FIELDS = ("kernels", "fused_mlm_loss", "attention_kernel", "decoder_pad_multiple")
# The fields only the heads read (the MLM decoder and loss, the classifier): the encoder alone has none of them
# (decoder_init_range initialises every Linear, as in the released code)
HEAD_FIELDS = ("decoder_pad_multiple", "fused_mlm_loss", "classifier_dropout", "classifier_init_range", "num_labels")


# A GEMM tile is at most 256 rows: a multiple above this only adds rows of zeros (and memory) to the decoder's matmul.
MAX_DECODER_PAD_MULTIPLE = 1024


class ModelFieldError(ValueError):
    """A NeoBERTConfig field with a value it cannot take: `field` names it (a job's config names its own key)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"NeoBERTConfig.{field} {reason}")
        self.field, self.reason = field, reason

    def as_config_error(self, key_prefix: str) -> ConfigError:
        """The error in the words of the job whose config key `key_prefix` + field set this field."""
        return ConfigError(f"invalid config key '{key_prefix}{self.field}': {self.reason}")


def _is_number(value: Any) -> bool:
    """An int or a float, not a bool (True would pass as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class NeoBERTConfig:
    """Every architectural choice of the NeoBERT ablation ladder is a field (paper Table 1 and Table 2)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 28
    num_attention_heads: int = 12
    # The hub's `intermediate_size`; SwiGLU uses 2/3 of it rounded up to a multiple of 8 (3072 -> 2048).
    intermediate_size: int = 3072
    activation: str = "swiglu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    position_encoding: str = "rope"
    rope_theta: float = 10000.0
    max_length: int = 4096
    pad_token_id: int = 0
    dropout: float = 0.0
    classifier_dropout: float = 0.1
    attention_backend: str = "sdpa"
    # Which kernels run the norms and the MLP (neobert.model.kernels: eager, liger's norms and SwiGLU, or quack's MLP
    # with SwiGLU in its GEMMs): a choice of the machine, not of the model, so it is not written to config.json.
    kernels: str = "eager"
    # The MLM head in training as Liger's fused linear cross-entropy (neobert.model.kernels; needs liger-kernel, runs
    # on a GPU): no logits kept, which saves memory at a cost in time (docs/benchmarks.md), hence off. The machine's
    # choice too.
    fused_mlm_loss: bool = False
    # Which kernel runs attention over packed (cu_seqlens) batches (neobert.model.attention: auto takes the fastest
    # installed; an explicit one is measured against it by experiments.throughput): also the machine's choice.
    attention_kernel: str = "auto"
    # The MLM decoder's matmuls with the vocabulary padded by zero rows to a multiple of this, in the computation only
    # (the weight, the checkpoint and the logits keep vocab_size; 1 = as is): rows of 30,522 bf16 logits are not
    # 16-byte aligned, which keeps cuBLAS off its aligned kernels. The machine's choice too; the eager head's (the fused
    # loss takes the weight).
    decoder_pad_multiple: int = 1
    embedding_init_range: float = 0.02
    decoder_init_range: float = 0.02
    classifier_init_range: float = 0.02
    # Used by the sequence-classification head only; 1 means regression (MSE), as for STS-B.
    num_labels: int = 2

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_hidden_size(self) -> int:
        if self.activation == "swiglu":
            multiple_of = 8
            hidden = int(2 * self.intermediate_size / 3)
            return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        return self.intermediate_size

    def validate(self) -> None:
        for name, allowed in (
            ("position_encoding", POSITION_ENCODINGS),
            ("activation", ACTIVATIONS),
            ("norm", NORMS),
            ("attention_backend", ATTENTION_BACKENDS),
            ("kernels", KERNELS),
            ("attention_kernel", ATTENTION_KERNELS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ModelFieldError(name, f"must be one of {allowed}, got {value!r}")
        if not isinstance(self.fused_mlm_loss, bool):
            raise ModelFieldError("fused_mlm_loss", f"must be true or false, got {self.fused_mlm_loss!r}")
        if self.kernels == "liger" and (missing := liger_missing_reason()):
            raise ModelFieldError("kernels", f"'liger' {missing}; 'eager' runs everywhere")
        if self.kernels == "quack" and (missing := quack_missing_reason()):
            raise ModelFieldError("kernels", f"'quack' {missing}; 'eager' runs everywhere")
        if self.fused_mlm_loss and (missing := liger_missing_reason()):
            raise ModelFieldError("fused_mlm_loss", f"true {missing}; false runs everywhere")
        if missing := attention_kernel_missing_reason(self.attention_kernel):
            raise ModelFieldError("attention_kernel", f"{self.attention_kernel!r} {missing}; 'auto' runs everywhere")
        if isinstance(self.decoder_pad_multiple, bool) or not isinstance(self.decoder_pad_multiple, int) \
                or not 1 <= self.decoder_pad_multiple <= MAX_DECODER_PAD_MULTIPLE:
            raise ModelFieldError("decoder_pad_multiple", f"must be a positive integer of at most "
                                                          f"{MAX_DECODER_PAD_MULTIPLE:,} (1 = no padding; 64 pads "
                                                          f"30,522 rows to 30,528), got {self.decoder_pad_multiple!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_length", "num_labels"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"NeoBERTConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.position_encoding == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions: head_dim={self.head_dim} must be even")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary (size {self.vocab_size})")
        for name in ("dropout", "classifier_dropout"):
            value = getattr(self, name)
            if not _is_number(value) or not 0.0 <= value < 1.0:
                raise ModelFieldError(name, f"must be a number in [0, 1), got {value!r}")
        if not _is_number(self.norm_eps) or not self.norm_eps > 0:
            raise ModelFieldError("norm_eps", f"must be a positive number, got {self.norm_eps!r}")
        theta = self.rope_theta
        if not _is_number(theta) or not 0 < theta < math.inf:
            # the base of RoPE's frequencies theta^(-2i/d): 0 or below gives inf or NaN angles, a NaN loss
            raise ModelFieldError("rope_theta", f"must be a positive number (the RoPE base, e.g. 10000.0), got "
                                                f"{theta!r}")

    # ------------------------------------------------------------------ presets
    @property
    def decoder_rows(self) -> int:
        """The rows the MLM decoder's matmul runs on: vocab_size padded to decoder_pad_multiple."""
        return self.vocab_size + -self.vocab_size % self.decoder_pad_multiple

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "NeoBERTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown NeoBERTConfig field(s) {unknown}; known fields: {sorted(fields)}")
        return cls(**{**PRESETS[name], **overrides})

    # ------------------------------------------------------------------ hub config.json
    def to_hub_dict(self) -> dict[str, Any]:
        """`config.json` with the hub's field names (chandar-lab/NeoBERT) plus this suite's extra fields."""
        hub = {
            "model_type": "neobert",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "dim_head": self.head_dim,
            "norm_eps": self.norm_eps,
            "max_length": self.max_length,
            "vocab_size": self.vocab_size,
            "pad_token_id": self.pad_token_id,
            "embedding_init_range": self.embedding_init_range,
            "decoder_init_range": self.decoder_init_range,
            "classifier_init_range": self.classifier_init_range,
        }
        for name in _EXTRA_HUB_FIELDS:
            hub[name] = getattr(self, name)
        return hub

    @classmethod
    def from_hub_dict(cls, hub: dict[str, Any]) -> "NeoBERTConfig":
        """Reads an official or our own `config.json`. Fields the official file lacks take the NeoBERT values."""
        model_type = hub.get("model_type", "neobert")
        if model_type != "neobert":
            raise ValueError(f"config.json has model_type={model_type!r}, expected 'neobert'")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hub.items() if k in names}
        # The official code default is max_length 1024 and eps 1e-6 when the file omits them.
        values.setdefault("max_length", 1024)
        values.setdefault("norm_eps", 1e-6)
        config = cls(**values)
        if "dim_head" in hub and hub["dim_head"] != config.head_dim:
            raise ValueError(
                f"config.json: dim_head={hub['dim_head']} but hidden_size/num_attention_heads={config.head_dim}"
            )
        return config


_EXTRA_HUB_FIELDS = ("activation", "norm", "position_encoding", "rope_theta", "dropout", "classifier_dropout",
                     "attention_backend", "num_labels")

PRESETS: dict[str, dict[str, Any]] = {
    # The released NeoBERT (paper Table 1; the hub config).
    "neobert": {},
    # Ablation M0: a BERT-base-like encoder in the same code path.
    "bert-base": dict(num_hidden_layers=12, activation="gelu", norm="layernorm", norm_eps=1e-12,
                      position_encoding="learned", max_length=512, dropout=0.1),
    # Ablation M8: 250M parameters, 16 x 1056. The paper gives no head count; 12 heads keep head_dim=88,
    # a multiple of 8 as FlashAttention requires.
    "neobert-16x1056": dict(num_hidden_layers=16, hidden_size=1056, intermediate_size=4224, max_length=512),
    # Small models for laptops, demos and tests.
    "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                 max_length=512),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=192,
                 max_length=512),
}
