"""The pseudo-perplexity job (paper Figure 2; docs/ablations.md): load every model of the config, choose its
documents and score them (the measurement: `neobert.eval.pseudo_perplexity`), then write documents.csv (one row per
model and document), buckets.json, pseudo_perplexity.md and pseudo_perplexity.png under `output_dir`; and
`ladder_pseudo_perplexity`, Figure 2 over the runs of an ablation ladder (the notebook's).
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from neobert.config.pseudo_perplexity import PseudoPerplexityConfig
from neobert.data.corpus import iterate_documents, truncate
from neobert.eval.device import resolve_device
from neobert.eval.plots import plot_pseudo_perplexity
from neobert.eval.probes import ladder_probe_runs
from neobert.eval.pseudo_perplexity import (BucketScore, DocumentScore, bucket_scores, load_model_and_tokenizer,
                                            score_documents, select_documents)
from neobert.layout import EXPORT_DIR, PPPL_BUCKETS_JSON, PPPL_DOCUMENTS_CSV, PPPL_MD, PPPL_PLOT
from neobert.model.checkpoint import read_config

log = logging.getLogger(__name__)


def run_pseudo_perplexity_job(config: PseudoPerplexityConfig) -> dict[str, Path]:
    """Scores, writes the reports and returns their paths ({"documents", "buckets", "markdown", "plot"})."""
    scores, buckets = run_pseudo_perplexity(config)
    return write_reports(scores, buckets, config.output_dir)


def write_reports(scores: list[DocumentScore], buckets: list[BucketScore], output_dir: str | Path) -> dict[str, Path]:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    documents_csv = output_dir / PPPL_DOCUMENTS_CSV
    with documents_csv.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(scores[0])))
        writer.writeheader()
        writer.writerows(asdict(s) for s in scores)
    buckets_json = output_dir / PPPL_BUCKETS_JSON
    buckets_json.write_text(json.dumps([asdict(b) for b in buckets], indent=2) + "\n")
    table = output_dir / PPPL_MD
    table.write_text(markdown_table(buckets) + "\n")
    plot = plot_pseudo_perplexity(curves(buckets), output_dir / PPPL_PLOT)
    return {"documents": documents_csv, "buckets": buckets_json, "markdown": table, "plot": plot}


def run_pseudo_perplexity(config: PseudoPerplexityConfig) -> tuple[list[DocumentScore], list[BucketScore]]:
    """Scores every model of the config on the same documents: (per-document scores, per-bucket scores)."""
    config.validate()
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    all_scores: list[DocumentScore] = []
    for directory in config.models:
        model, tokenizer = load_model_and_tokenizer(directory, config.tokenizer)
        model.to(device)
        max_length = config.max_length or model.config.max_length
        special = set(tokenizer.all_special_ids)
        documents = (truncate(ids, max_length, special) for ids in iterate_documents(config.data, tokenizer))
        chosen = select_documents(documents, config.bucket_edges, config.docs_per_bucket, config.min_tokens,
                                  config.max_scanned_documents)
        if not chosen:
            raise RuntimeError(f"data.source={config.data.source!r} gave no document of at least "
                               f"{config.min_tokens} tokens")
        name = Path(directory).name if Path(directory).name != EXPORT_DIR else Path(directory).parent.name
        log.info("%s: scoring %d documents", name, len(chosen))
        all_scores += score_documents(model, chosen, special, tokenizer.mask_token_id, name,
                                      config.tokens_per_forward, progress=lambda d: tqdm(d, desc=name),
                                      dtype=getattr(torch, config.dtype) if config.dtype else None)
    return all_scores, bucket_scores(all_scores, list(config.bucket_edges))


def curves(buckets: list[BucketScore]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for b in buckets:
        out.setdefault(b.model, []).append((b.bucket_high, b.pppl))
    return out


def markdown_table(buckets: list[BucketScore]) -> str:
    lines = ["| model | length bucket (tokens) | documents | scored tokens | PPPL | median document PPPL |",
             "|---|---|---:|---:|---:|---:|"]
    for b in buckets:
        lines.append(f"| {b.model} | {b.bucket_low + 1}-{b.bucket_high} | {b.documents} | {b.scored_tokens} | "
                     f"{b.pppl:.2f} | {b.median_document_pppl:.2f} |")
    return "\n".join(lines)


def ladder_pseudo_perplexity(results: Sequence[dict], corpus: str | Path, bucket_edges: Sequence[int] | None = None,
                             docs_per_bucket: int = 2, steps: Sequence[str] | None = None,
                             seed: int | None = None) -> list[BucketScore]:
    """Per-bucket pseudo-perplexity of one run per step (`ladder_probe_runs`, labelled by step) on `corpus`, a local
    .jsonl file with a `content` column (Figure 2 over the ladder). `bucket_edges` default: powers of two from 16,
    then the smallest max_length of those checkpoints (longer documents are truncated into that last bucket). Only
    comparable between checkpoints that share a tokenizer."""
    if not Path(corpus).is_file():
        raise FileNotFoundError(f"{corpus} is missing: the ladder writes corpora/heldout.jsonl only at budgets with "
                                f"held-out documents (heldout.documents > 0); pass another local .jsonl file")
    exports = ladder_probe_runs([r for r in results if steps is None or r["step"] in steps], seed)
    if bucket_edges is None:
        max_length = min(read_config(export_dir).max_length for export_dir in exports.values())
        bucket_edges = [2 ** k for k in range(4, max_length.bit_length()) if 2 ** k < max_length] + [max_length]
    buckets = []
    # One measurement per step: the scorer names a model by its run directory (seed<k>), the same for every step.
    for step, export_dir in exports.items():
        config = PseudoPerplexityConfig(models=[export_dir], bucket_edges=list(bucket_edges),
                                        docs_per_bucket=docs_per_bucket, device="cpu")
        config.data.source = str(corpus)
        config.data.hub_config = None
        config.data.text_column = "content"
        buckets += [replace(b, model=step) for b in run_pseudo_perplexity(config)[1]]
    return buckets
