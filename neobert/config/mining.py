"""The schema of hard-negative mining (`python -m experiments.mine_negatives`): embed (query, positive) examples and
a corpus, retrieve each query's nearest corpus texts, and keep the best-ranked ones that score clearly below the
query's positive (those above it are likely unlabelled positives, "false negatives")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, Optional

from neobert.config.common import KERNELS_MOVED, check_load_time_overrides
from neobert.config.loader import require

SEARCHES = ("exact", "faiss")
EMBEDDERS = ("auto", "backbone", "sentence-transformers")
CORPUS_SUFFIXES = (".txt", ".jsonl")


@dataclass
class MiningConfig:
    # Our checkpoint dir, any HF encoder dir or hub name, a sentence-transformers dir, or preset:<name>.
    model: str = "chandar-lab/NeoBERT"
    tokenizer: Optional[str] = None  # backbone embedder only; default: beside the weights
    # NeoBERTConfig fields the loaded model changes (the backbone embedder's NeoBERT models; other encoders run their
    # own code): kernels, eager | liger (Liger-Kernel's RMSNorm and SwiGLU on a GPU) | quack (QuACK's MLP on a GPU),
    # neobert.model.kernels.
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    # The (query, positive) file: any layout of neobert.data.contrastive.read_local_examples.
    input: str = ""
    sts_min_score: float = 4.0  # STS layouts: pairs scoring at least this are (query, positive)
    corpus: Optional[str] = None  # .txt (a document a line) or .jsonl (a `text` column); None: the input's texts
    output: str = ""  # .jsonl of {query, positive, negatives, negative_scores, positive_score}
    num_negatives: int = 5
    top_k: int = 50  # candidates retrieved per query
    skip_top: int = 0  # best ranks never used, counted after the query's own texts (ST's range_min)
    margin: float = 0.0  # keep a candidate only if score <= positive_score - margin
    max_score_ratio: Optional[float] = None  # and (when set) only if score <= max_score_ratio * positive_score
    search: str = "exact"  # exact: torch matmul + topk; faiss: IndexFlatIP (pip install faiss-cpu)
    embedder: str = "auto"  # auto: sentence-transformers when the model dir has modules.json, else backbone
    batch_size: int = 64
    max_length: Optional[int] = 256
    query_instruction: str = ""
    document_instruction: str = ""  # for positives and corpus texts
    device: Optional[str] = None  # default: cuda if available
    seed: int = 0  # fixes the weights of a preset:<name> model

    RENAMED_KEYS: ClassVar[Dict[str, str]] = KERNELS_MOVED

    def validate(self) -> None:
        check_load_time_overrides(self.model_overrides)
        require(bool(self.input), "input", "required: the (query, positive) file to mine negatives for")
        require(Path(self.input).is_file(), "input", f"file {self.input!r} does not exist")
        if self.corpus is not None:
            require(Path(self.corpus).is_file(), "corpus", f"file {self.corpus!r} does not exist")
            require(Path(self.corpus).suffix in CORPUS_SUFFIXES, "corpus",
                    f"{self.corpus!r}: expected a .txt (a document a line) or a .jsonl with a `text` column")
        require(bool(self.output), "output", "required: the .jsonl file to write")
        require(Path(self.output).suffix == ".jsonl", "output", f"{self.output!r}: must end in .jsonl")
        require(self.num_negatives > 0, "num_negatives", "must be positive")
        require(self.skip_top >= 0, "skip_top", "must be >= 0")
        require(self.top_k >= self.num_negatives + self.skip_top, "top_k",
                f"must be at least num_negatives + skip_top ({self.num_negatives + self.skip_top})")
        require(self.margin >= 0, "margin", "must be >= 0 (0 keeps every candidate scoring below the positive)")
        require(self.max_score_ratio is None or 0 < self.max_score_ratio <= 1, "max_score_ratio",
                "must be in (0, 1] or null")
        require(self.search in SEARCHES, "search", f"{self.search!r} is not one of {SEARCHES}")
        require(self.embedder in EMBEDDERS, "embedder", f"{self.embedder!r} is not one of {EMBEDDERS}")
        require(self.batch_size > 0, "batch_size", "must be positive")
        require(self.max_length is None or self.max_length > 0, "max_length", "must be positive or null")
