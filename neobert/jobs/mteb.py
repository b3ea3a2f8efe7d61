"""MTEB evaluation, the whole job (paper Section 5.2, Table 4): resolve the tasks, load the encoder, evaluate with
the per-task instructions (the measurements: `neobert.eval.mteb`), and write results.json, summary.json and
summary.md under output_dir (`run_mteb`, also the contrastive job's STS score). `python -m experiments.mteb` is its
command line; docs/contrastive_mteb.md the guide.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from neobert.config.mteb import MtebConfig
from neobert.data.backbone import load_backbone
from neobert.eval.mteb import MtebEncoder, TaskInstructions, resolve_tasks, score_tasks, trained_dims
from neobert.layout import MTEB_SUMMARY_JSON, MTEB_SUMMARY_MD, RESULTS_JSON

log = logging.getLogger(__name__)

# Paper Table 4 columns: mteb task type -> column name.
TABLE4_COLUMNS = {
    "Classification": "Classification",
    "Clustering": "Clustering",
    "PairClassification": "Pair classification",
    "Reranking": "Reranking",
    "Retrieval": "Retrieval",
    "STS": "STS",
    "Summarization": "Summarization",
}


def evaluate_model(config: MtebConfig, show_progress_bar: bool = True) -> dict[str, Any]:
    tasks = resolve_tasks(config.tasks, config.max_examples, config.beir_split)  # before loading the model: bad specs fail fast
    backbone = load_backbone(config.model, tokenizer=config.tokenizer, **config.model_overrides)
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
    return run_mteb(encoder, tasks, config.output_dir, config.batch_size, show_progress_bar)


def run_mteb(encoder: MtebEncoder, tasks: Sequence, output_dir: str | Path, batch_size: int = 64,
             show_progress_bar: bool = True) -> dict[str, Any]:
    """Evaluates `encoder` on `tasks` (`neobert.eval.mteb.score_tasks`) and returns {"tasks": {name: {type,
    main_score, scores}}, "summary": Table 4 averages, "max_length": {tokens, source} (our encoder's truncation)};
    writes them under output_dir."""
    per_task = score_tasks(encoder, tasks, batch_size, show_progress_bar)
    report = {"model": encoder.mteb_model_meta.name, "tasks": per_task, "summary": table4_summary(per_task)}
    limit = getattr(encoder, "length_limit", None)  # any mteb encoder may be scored; ours says how it truncates
    if limit is not None:
        report["max_length"] = limit.to_dict()
    write_report(report, output_dir)
    return report


def table4_summary(per_task: dict[str, dict]) -> dict[str, Optional[float]]:
    """Mean main score x 100 per task type (the paper's Table 4 columns) and the average over all tasks (the
    MTEB convention); None where no task of that type was run."""
    summary: dict[str, Optional[float]] = {}
    for task_type, column in TABLE4_COLUMNS.items():
        scores = [t["main_score"] for t in per_task.values() if t["type"] == task_type]
        summary[column] = 100 * float(np.mean(scores)) if scores else None
    all_scores = [t["main_score"] for t in per_task.values()]
    summary["Average"] = 100 * float(np.mean(all_scores)) if all_scores else None
    return summary


def write_report(report: dict[str, Any], output_dir: str | Path) -> None:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / RESULTS_JSON).write_text(json.dumps(report["tasks"], indent=2) + "\n")
    summary = {"model": report["model"], **report["summary"]}
    if "max_length" in report:
        summary["max_length"] = report["max_length"]
    (output_dir / MTEB_SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    (output_dir / MTEB_SUMMARY_MD).write_text(summary_markdown(report))


def summary_markdown(report: dict[str, Any]) -> str:
    def cell(value: Optional[float]) -> str:
        return "-" if value is None or math.isnan(value) else f"{value:.2f}"

    columns = [*TABLE4_COLUMNS.values(), "Average"]
    lines = [f"| Model | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|",
             f"| {report['model']} | {' | '.join(cell(report['summary'][c]) for c in columns)} |", "",
             "| Task | Type | Main score (x100) |", "|---|---|---|"]
    lines += [f"| {name} | {t['type']} | {100 * t['main_score']:.2f} |" for name, t in report["tasks"].items()]
    if "max_length" in report:
        limit = report["max_length"]
        lines += ["", f"Texts truncated to {limit['tokens']} tokens: {limit['source']}."]
    return "\n".join(lines) + "\n"
