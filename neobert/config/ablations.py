"""The schema of an ablation budget (`neobert/configs/ablations/budgets/<name>.yaml`): how the ladder M0..M10
(paper Table 2, Figure 1) is rescaled from the paper's shapes, lengths and batch sizes, and how each checkpoint
is evaluated. The step configs themselves are PretrainConfigs (`neobert/configs/ablations/mXX.yaml`);
docs/ablations.md describes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from neobert.config.loader import require


@dataclass
class ModelShapeConfig:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int


@dataclass
class GlueSubsetConfig:
    """How each checkpoint is evaluated: a short fine-tune per task (neobert.jobs.glue.run_task)."""

    tasks: List[str] = field(default_factory=lambda: ["rte"])
    # Local GLUE files (hub parquet or GLUE TSV layout); "auto": $NEOBERT_SHARED_DATA/glue (unset:
    # ../shared/data/glue from the working directory) when it holds rte/, else the built-in fallback task;
    # None: the hub's nyu-mll/glue.
    data_path: Optional[str] = "auto"
    max_train_steps: int = 0  # 0 = the full fine-tuning (10 epochs)
    batch_size: int = 16
    lr: float = 2e-5
    max_length: int = 128
    max_train_examples: int = 0
    max_eval_examples: int = 0
    seed: int = 0


@dataclass
class HeldOutConfig:
    """The evaluation every checkpoint of the ladder gets alike (docs/ablations.md): the first `documents`
    documents of the `source` corpus are kept out of every step's training and scored at a fixed masking rate,
    with all masked tokens [MASK] and the same masked positions for every step that shares a tokenizer."""

    source: str = "demo"  # "demo" or "offline" (a corpus the budget writes), or a local .jsonl with `content`
    documents: int = 0  # 0 = no held-out evaluation
    mask_rate: float = 0.15
    max_length: int = 128
    batch_size: int = 32
    pseudo_perplexity_documents: int = 0  # the first N held-out documents, every token masked once (0 = off)
    pseudo_perplexity_max_length: int = 64

    def validate(self, prefix: str = "heldout") -> None:
        require(self.documents >= 0, f"{prefix}.documents", "must be >= 0 (0 = no held-out evaluation)")
        require(0 < self.mask_rate < 1, f"{prefix}.mask_rate", f"must be in (0, 1), got {self.mask_rate}")
        require(self.max_length >= 8 and self.pseudo_perplexity_max_length >= 8, f"{prefix}.max_length",
                "max_length and pseudo_perplexity_max_length must be at least 8")
        require(0 <= self.pseudo_perplexity_documents <= self.documents, f"{prefix}.pseudo_perplexity_documents",
                f"must be between 0 and {prefix}.documents={self.documents} (it scores held-out documents)")


@dataclass
class StsProbeConfig:
    """A downstream signal that moves at small scale: STS Benchmark dev Spearman of mean-pooled embeddings, before
    and after a short contrastive fine-tune (InfoNCE) on the train pairs scored >= 4 (neobert.jobs.contrastive)."""

    # A folder with sts-train.csv and sts-dev.csv; "auto": $NEOBERT_SHARED_DATA/stsbenchmark (unset:
    # ../shared/data/stsbenchmark from the working directory) when it exists, else no STS probe; None: off.
    data_dir: Optional[str] = None
    finetune_steps: int = 0  # 0 = zero-shot only
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 5
    max_length: int = 64

    def validate(self, prefix: str = "sts") -> None:
        require(self.finetune_steps >= 0, f"{prefix}.finetune_steps", "must be >= 0 (0 = zero-shot only)")
        require(self.batch_size > 1, f"{prefix}.batch_size", "must be at least 2 (in-batch negatives)")


@dataclass
class AblationBudgetConfig:
    name: str = "paper"
    max_steps: Optional[int] = None  # None keeps the step's value
    warmup_steps: Optional[int] = None  # caps every step's warm-up
    # Multiplies every step's peak lr: tiny models trained for a few dozen steps need a larger one. Applied to
    # the step and its parent alike, so the steps' relative lr (M4 changes it) is kept.
    lr_scale: float = 1.0
    devices: Optional[int] = None
    micro_batch_size: Optional[int] = None  # most sequences per micro batch; accumulation makes up the rest
    shapes: Dict[str, ModelShapeConfig] = field(default_factory=dict)  # "12x768" -> the budget's shape
    lengths: Dict[str, int] = field(default_factory=dict)  # paper max length -> budget max length
    tokens_per_step: Dict[str, int] = field(default_factory=dict)  # paper tokens/step -> budget tokens/step
    # The paper's data source of a step (wikimedia/wikipedia, tiiuae/falcon-refinedweb) -> what this budget trains
    # on instead: "demo" (the demo corpus, 0.5 MB), "offline" (the offline prose corpus, tens of MB; both written
    # under the output directory) or a local file; a source not listed is kept.
    data_sources: Dict[str, str] = field(default_factory=dict)
    seeds: List[int] = field(default_factory=lambda: [0])  # every step runs once per seed (trainer and data seed)
    bpe_vocab_size: int = 32000  # the trained stand-in of the LLaMA tokenizer when the hub is out of reach
    pretrain_overrides: Dict[str, Any] = field(default_factory=dict)  # dotted PretrainConfig keys for every step
    heldout: HeldOutConfig = field(default_factory=HeldOutConfig)
    sts: StsProbeConfig = field(default_factory=StsProbeConfig)
    glue: GlueSubsetConfig = field(default_factory=GlueSubsetConfig)  # tasks: [] = no GLUE fine-tune

    def validate(self) -> None:
        require(bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), "seeds",
                f"must be a non-empty list of distinct seeds, got {self.seeds}")
        require(all(self.data_sources.values()), "data_sources",
                f"values must be demo, offline or a local file, got {dict(self.data_sources)}")
        self.heldout.validate()
        self.sts.validate()
