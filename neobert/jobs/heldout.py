"""Held-out MLM loss of exported models on the held-out documents of several sources, one table
(`python -m experiments.heldout`): every model scored alike (`neobert.eval.heldout.heldout_mlm_loss`: the same
documents, length, masking rate and masked positions), whatever lengths and rates its training used. The
comparison of a phased recipe with a single-phase run of the same tokens (docs/benchmarks.md) uses it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Mapping

from neobert.eval.heldout import heldout_mlm_loss
from neobert.eval.pseudo_perplexity import load_model_and_tokenizer

HELDOUT_MARKDOWN, HELDOUT_JSON = "heldout.md", "heldout.json"


def heldout_job(models: Mapping[str, str | Path], sources: Mapping[str, str | Path], output_dir: str | Path,
                documents: int = 32, max_length: int = 128, mask_rate: float = 0.2) -> dict[str, Path]:
    """Scores each model (label -> export directory) on the first `documents` documents of each source (name ->
    local corpus, those a run held out with data.validation_docs >= documents); a model label `group/seed` is
    also averaged over its group. Writes heldout.md and heldout.json under output_dir."""
    scores: dict[str, dict[str, float]] = {}
    for label, directory in models.items():
        model, tokenizer = load_model_and_tokenizer(str(directory))
        scores[label] = {name: heldout_mlm_loss(model, tokenizer, str(path), documents, max_length,
                                                mask_rate)["loss"] for name, path in sources.items()}
        scores[label]["all"] = statistics.mean(scores[label][name] for name in sources)
    groups: dict[str, list[str]] = {}
    for label in models:
        groups.setdefault(label.split("/")[0], []).append(label)
    columns = list(sources) + ["all"]
    lines = [f"Held-out MLM loss (nats; the first {documents} documents of each source, {max_length} tokens, "
             f"{mask_rate:.0%} of the tokens masked, all [MASK], one fixed mask; `all` = the mean over sources)",
             "", "| model | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {label} | " + " | ".join(f"{scores[label][c]:.4f}" for c in columns) + " |" for label in models]
    if any(len(members) > 1 for members in groups.values()):
        lines += ["", "| mean (sd) over | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        for group, members in groups.items():
            cells = [f"{statistics.mean(scores[m][c] for m in members):.4f} "
                     f"({statistics.stdev(scores[m][c] for m in members) if len(members) > 1 else 0:.4f})"
                     for c in columns]
            lines.append(f"| {group} ({len(members)}) | " + " | ".join(cells) + " |")
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / HELDOUT_MARKDOWN).write_text("\n".join(lines) + "\n")
    (output / HELDOUT_JSON).write_text(json.dumps(scores, indent=1) + "\n")
    return {"markdown": output / HELDOUT_MARKDOWN, "json": output / HELDOUT_JSON}
