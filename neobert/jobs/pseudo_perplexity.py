"""The pseudo-perplexity job (paper Figure 2; docs/ablations.md): score every model's documents, then write
documents.csv (one row per model and document), buckets.json, pseudo_perplexity.md and pseudo_perplexity.png
under `output_dir`."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

from neobert.config.pseudo_perplexity import PseudoPerplexityConfig
from neobert.eval.plots import plot_pseudo_perplexity
from neobert.eval.pseudo_perplexity import (BucketScore, DocumentScore, curves, markdown_table,
                                            run_pseudo_perplexity)
from neobert.layout import PPPL_BUCKETS_JSON, PPPL_DOCUMENTS_CSV, PPPL_MD, PPPL_PLOT


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
