"""The long-context retrieval job (LongEmbed's synthetic passkey and needle tasks, offline; docs/contrastive_mteb.md,
section 5): for each model, generate the tasks at each length in its own tokenizer's tokens, refuse any length past
its max_length, score with mteb (nDCG@1 per length), and write long_context.json, long_context.md,
long_context.png and the generated data (data/<model>_<task>.jsonl) under output_dir."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from neobert.config import config_path
from neobert.config.long_context import STANDARD_LENGTHS, LongContextConfig
from neobert.config.loader import require
from neobert.data.backbone import load_backbone
from neobert.data.long_context import generate, hidden_sentence_tokens, token_counter
from neobert.eval.long_context import MAIN_SCORE, markdown_table, score_long_context
from neobert.eval.mteb import MtebEncoder, TaskInstructions
from neobert.eval.plots import plot_long_context
from neobert.layout import LONG_CONTEXT_DATA_DIR, LONG_CONTEXT_JSON, LONG_CONTEXT_MD, LONG_CONTEXT_PLOT

log = logging.getLogger(__name__)


def model_label(spec: str) -> tuple[str, str]:
    """`label=path` or `path` -> (label, path); a path's label is its last two parts (runs/x/export -> x/export)."""
    if "=" in spec and not spec.startswith("preset:"):
        label, _, path = spec.partition("=")
        return label, path
    return "/".join(Path(spec).parts[-2:]) if not spec.startswith("preset:") else spec, spec


def lengths_for(config: LongContextConfig, max_length: int, model: str) -> list[int]:
    """The lengths to evaluate a model at: the asked ones (each within max_length, else refused), or the
    standard ones up to max_length."""
    if config.lengths is None:
        lengths = [n for n in STANDARD_LENGTHS if n <= max_length]
        left_out = [n for n in STANDARD_LENGTHS if n > max_length]
        if left_out:
            log.info("%s: max_length %d, so lengths %s are left out", model, max_length, left_out)
        require(bool(lengths), "lengths", f"{model} reads at most {max_length} tokens, shorter than every standard "
                                          f"length {list(STANDARD_LENGTHS)}: give shorter lengths, e.g. "
                                          f"lengths=[{max_length // 4},{max_length // 2},{max_length}]")
        return lengths
    too_long = [n for n in config.lengths if n > max_length]
    require(not too_long, "lengths", f"{too_long} exceed the max_length of {model} ({max_length} tokens); it cannot "
                                     f"read longer documents (truncating them would hide the key): choose lengths "
                                     f"<= {max_length}")
    return sorted(set(config.lengths))


def refuse_short_lengths(config: LongContextConfig, lengths: list[int], count, model: str) -> None:
    """Every length must hold each task's hidden sentence whole (in the model's own tokens), before any work."""
    for task in config.tasks:
        needed = hidden_sentence_tokens(task, lengths, count, config.examples_per_length, config.seed)
        short = [n for n in lengths if needed[n] > n]
        if short:
            require(False, "lengths", f"{short} cannot hold the {task} task's hidden sentence (up to "
                                      f"{max(needed[n] for n in short)} tokens of {model}'s tokenizer): choose "
                                      f"longer lengths (LongEmbed's start at {STANDARD_LENGTHS[0]})")


def run_long_context(config: LongContextConfig, show_progress: bool = True) -> dict[str, Any]:
    instructions = TaskInstructions.load(None if config.instructions.lower() == "none"
                                         else config_path(config.instructions))
    output_dir = Path(config.output_dir)
    results: dict[str, Any] = {}
    for spec in config.models:
        label, path = model_label(spec)
        backbone = load_backbone(path, tokenizer=config.tokenizer)
        max_length = backbone.max_length
        lengths = lengths_for(config, max_length, path)
        count = token_counter(backbone.tokenizer)
        refuse_short_lengths(config, lengths, count, path)
        examples = {task: generate(task, lengths, count, config.examples_per_length, config.seed,
                                   config.length_tolerance)
                    for task in config.tasks}
        data_dir = output_dir / LONG_CONTEXT_DATA_DIR
        data_dir.mkdir(parents=True, exist_ok=True)
        for task, rows in examples.items():
            slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
            (data_dir / f"{slug}_{task}.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in rows))
        encoder = MtebEncoder(backbone, instructions, config.batch_size, max_length, config.device,
                              getattr(torch, config.dtype) if config.dtype else None, name=label)
        scores = score_long_context(encoder, examples, config.batch_size)
        tokens = {task: {n: [r.tokens for r in rows if r.length == n] for n in lengths}
                  for task, rows in examples.items()}
        results[label] = {"model": path, "max_length": max_length, "lengths": lengths,
                          "examples_per_length": config.examples_per_length, "seed": config.seed,
                          "document_tokens": {t: {n: [min(v), max(v)] for n, v in per.items()}
                                              for t, per in tokens.items()},
                          "scores": scores}
        for task, per_length in scores.items():
            log.info("%s %s nDCG@1: %s", label, task,
                     ", ".join(f"{n}: {s[MAIN_SCORE]:.3f}" for n, s in per_length.items()))
    return write_reports(results, output_dir, config.examples_per_length)


def write_reports(results: dict[str, Any], output_dir: Path, candidates: int) -> dict[str, Any]:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / LONG_CONTEXT_JSON).write_text(json.dumps(results, indent=2) + "\n")
    table = markdown_table(results)
    (output_dir / LONG_CONTEXT_MD).write_text(table)
    curves = {f"{label} {task}": [(n, s[MAIN_SCORE]) for n, s in per_length.items()]
              for label, result in results.items() for task, per_length in result["scores"].items()}
    lengths = sorted({n for points in curves.values() for n, _ in points})
    plot = plot_long_context(curves, output_dir / LONG_CONTEXT_PLOT, chance={n: 1 / candidates for n in lengths})
    return {"results": results, "table": table, "json": output_dir / LONG_CONTEXT_JSON,
            "markdown": output_dir / LONG_CONTEXT_MD, "plot": plot}
