"""The schema of a pseudo-perplexity measurement (`python -m experiments.pseudo_perplexity key=value ...`;
paper Figure 2, docs/ablations.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from neobert.config.loader import require


@dataclass
class PseudoPerplexityDataConfig:
    """Where documents come from: a hub dataset (default: English Wikipedia) or local files (a file, a directory
    or a glob of .txt/.jsonl/.json/.parquet/.csv), read by the pretraining data code."""

    source: str = "wikimedia/wikipedia"
    hub_config: Optional[str] = "20231101.en"
    split: str = "train"
    text_column: str = "text"
    text_sample_by: str = "document"  # .txt files: "document" (one per file), "paragraph" or "line"
    # Read by the shared source code; pseudo-perplexity uses neither.
    pretokenized_dir: Optional[str] = None
    validation_docs: int = 0


@dataclass
class PseudoPerplexityConfig:
    models: List[str] = field(default_factory=list)  # export directories (NeoBERT hub layout)
    data: PseudoPerplexityDataConfig = field(default_factory=PseudoPerplexityDataConfig)
    tokenizer: Optional[str] = None  # default: the one saved beside each model, else bert-base-uncased
    max_length: Optional[int] = None  # truncation; default: each model's max_length
    # Bucket upper bounds (tokens, special tokens included): a document of n tokens falls in the first edge >= n.
    bucket_edges: List[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048, 4096])
    docs_per_bucket: int = 8  # stop collecting a bucket once it holds this many documents
    min_tokens: int = 8
    max_scanned_documents: int = 5000  # give up filling buckets after reading this many documents
    tokens_per_forward: int = 16384  # masked copies per forward pass = this // document length (at least 1)
    device: str = "auto"
    # Autocast dtype: bfloat16 (fast on GPUs and CPUs with avx512_bf16, emulated and slow on others); null = float32.
    dtype: Optional[str] = None
    seed: int = 0
    output_dir: str = "runs/pseudo_perplexity"

    def validate(self) -> None:
        require(bool(self.models), "models", "give at least one export directory, e.g. models=[runs/neobert/export]")
        require(self.dtype in (None, "float32", "bfloat16"), "dtype",
                f"must be float32, bfloat16 or null, got {self.dtype!r}")
        require(bool(self.bucket_edges) and sorted(self.bucket_edges) == list(self.bucket_edges), "bucket_edges",
                f"must be increasing, got {self.bucket_edges}")
