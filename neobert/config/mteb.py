"""The schema of an MTEB evaluation (`python -m experiments.mteb --config mteb`; paper Section 5.2, Table 4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional

from neobert.config.common import KERNELS_MOVED, check_load_time_overrides
from neobert.config.loader import ConfigError, config_path, require

NO_INSTRUCTIONS = "none"


@dataclass
class MtebConfig:
    model: str = "chandar-lab/NeoBERT"  # our checkpoint dir, any HF encoder dir or hub name, or preset:<name>
    tokenizer: Optional[str] = None  # default: beside the weights (bert-base-uncased for NeoBERT without one)
    tasks: List[str] = field(default_factory=lambda: ["english"])
    # JSON {"query": {task: text}, "document": {task: text}}: a path or a packaged file; "none" = no instructions.
    instructions: str = "mteb_instructions.json"
    batch_size: int = 64
    # Tokens per text; null = the model's own limit: sentence-transformers' max_seq_length (sentence_bert_config.json),
    # else NeoBERT's max_length, else the smaller of the position table and the tokenizer's model_max_length. The
    # summary says which limit was used and where it came from.
    max_length: Optional[int] = None
    max_examples: Optional[int] = None  # cap on the examples of local tasks (quick checks)
    beir_split: Optional[str] = None  # beir:<dir> tasks: the qrels split (qrels/<split>.tsv); null = the only one
    device: Optional[str] = None  # default: cuda if available
    # NeoBERTConfig fields the loaded model changes (NeoBERT models; other encoders run their own code): kernels,
    # eager | liger (Liger-Kernel's RMSNorm and SwiGLU on a GPU, neobert.model.kernels: faster eager inference,
    # docs/benchmarks.md) | quack (QuACK's MLP on a GPU, made for compiled inference; this job runs eager).
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    # Autocast dtype of the encoder: float32 | bfloat16; null = bfloat16 on GPU (the paper), float32 on CPU.
    # bfloat16 is faster on CPUs with avx512_bf16 or AMX, and far slower where it is emulated (a warning says so).
    dtype: Optional[str] = None
    # Evaluate embeddings truncated to their first `dim` dimensions, re-normalised (after Matryoshka training,
    # loss.matryoshka_dims); null = the whole embedding.
    dim: Optional[int] = None
    output_dir: str = "runs/mteb"

    RENAMED_KEYS: ClassVar[Dict[str, str]] = KERNELS_MOVED

    def instructions_file(self) -> Optional[Path]:
        """The instruction file, or None for "none"."""
        if self.instructions.lower() == NO_INSTRUCTIONS:
            return None
        return config_path(self.instructions)

    def validate(self) -> None:
        check_load_time_overrides(self.model_overrides)
        require(bool(self.tasks), "tasks", "no MTEB tasks given")
        require(self.batch_size > 0, "batch_size", "must be positive")
        require(self.max_length is None or self.max_length > 0, "max_length", "must be positive or null")
        require(self.max_examples is None or self.max_examples > 0, "max_examples", "must be positive or null")
        require(self.dim is None or self.dim > 0, "dim", "must be positive or null")
        require(self.dtype in (None, "float32", "bfloat16"), "dtype",
                f"must be float32, bfloat16 or null, got {self.dtype!r}")
        try:
            self.instructions_file()
        except ConfigError as err:
            require(False, "instructions", f"{err} ('{NO_INSTRUCTIONS}' evaluates without instructions)")
