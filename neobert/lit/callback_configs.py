"""Typed settings of the evaluation callbacks that a pretraining run can carry (both off by default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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


@dataclass
class MtebCallbackConfig:
    """Every `every_n_steps` pretraining steps, a quick zero-shot evaluation of the encoder on a small local STS
    or retrieval task, logged. 0 = off."""

    every_n_steps: int = 0
    task: str = "sts"  # "sts" (pairs with scores) or "retrieval"
    data_path: Optional[str] = None  # e.g. an STS Benchmark CSV (sts-dev.csv layout)
    max_examples: int = 500
    batch_size: int = 64
    max_length: int = 128
