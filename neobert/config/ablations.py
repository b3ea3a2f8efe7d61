"""The schema of an ablation budget (`neobert/configs/ablations/budgets/<name>.yaml`): how the ladder M0..M10
(paper Table 2, Figure 1) is rescaled from the paper's shapes, lengths and batch sizes, and how each checkpoint
is evaluated. The step configs themselves are PretrainConfigs (`neobert/configs/ablations/mXX.yaml`);
docs/ablations.md describes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


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
    data_source: Optional[str] = None  # "demo": the offline demo corpus for every step; None keeps each step's
    bpe_vocab_size: int = 32000  # the trained stand-in of the LLaMA tokenizer when the hub is out of reach
    pretrain_overrides: Dict[str, Any] = field(default_factory=dict)  # dotted PretrainConfig keys for every step
    glue: GlueSubsetConfig = field(default_factory=GlueSubsetConfig)
