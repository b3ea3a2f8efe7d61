"""MTEB evaluation, the whole job (paper Section 5.2, Table 4): resolve the tasks, load the encoder, evaluate with
the per-task instructions, and write results.json, summary.json and summary.md under output_dir.
`python -m experiments.mteb` is its command line; docs/contrastive_mteb.md the guide.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from neobert.config.mteb import MtebConfig
from neobert.data.backbone import load_backbone
from neobert.eval.mteb import MtebEncoder, TaskInstructions, resolve_tasks, run_mteb, trained_dims

log = logging.getLogger(__name__)


def evaluate_model(config: MtebConfig, show_progress_bar: bool = True) -> dict[str, Any]:
    tasks = resolve_tasks(config.tasks, config.max_examples, config.beir_split)  # before loading the model: bad specs fail fast
    backbone = load_backbone(config.model, tokenizer=config.tokenizer)
    dims = trained_dims(config.model)
    if config.dim is not None and config.dim != backbone.hidden_size and config.dim not in (dims or []):
        log.warning("dim=%d: %s was not trained for this truncation (%s); its scores may be poor", config.dim,
                    config.model, f"Matryoshka dims {dims}" if dims else "no matryoshka.json")
    name = config.model if config.dim is None else f"{config.model} (dim {config.dim})"
    encoder = MtebEncoder(backbone, TaskInstructions.load(config.instructions_file()), config.batch_size,
                          config.max_length, config.device, getattr(torch, config.dtype) if config.dtype else None,
                          name=name, dim=config.dim)
    limit = encoder.length_limit
    log.info("texts truncated to %d tokens: %s", limit.tokens, limit.source)
    if limit.model_tokens is not None and limit.tokens > limit.model_tokens:
        log.warning("max_length=%d is more than the model's own limit, %d tokens: texts are read further than its "
                    "authors evaluate it (null = the model's own limit)", limit.tokens, limit.model_tokens)
    return run_mteb(encoder, tasks, config.output_dir, config.batch_size, show_progress_bar)
