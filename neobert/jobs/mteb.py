"""MTEB evaluation, the whole job (paper Section 5.2, Table 4): resolve the tasks, load the encoder, evaluate with
the per-task instructions, and write results.json, summary.json and summary.md under output_dir.
`python -m experiments.mteb` is its command line; docs/contrastive_mteb.md the guide.
"""

from __future__ import annotations

from typing import Any

from neobert.config.mteb import MtebConfig
from neobert.data.backbone import load_backbone
from neobert.eval.mteb import MtebEncoder, TaskInstructions, resolve_tasks, run_mteb


def evaluate_model(config: MtebConfig, show_progress_bar: bool = True) -> dict[str, Any]:
    tasks = resolve_tasks(config.tasks, config.max_examples)  # before loading the model: bad specs fail fast
    backbone = load_backbone(config.model, tokenizer=config.tokenizer)
    encoder = MtebEncoder(backbone, TaskInstructions.load(config.instructions_file()), config.batch_size,
                          config.max_length, config.device, name=config.model)
    return run_mteb(encoder, tasks, config.output_dir, config.batch_size, show_progress_bar)
