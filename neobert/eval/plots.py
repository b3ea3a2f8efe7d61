"""The paper's figures, drawn from this suite's result files (used by the CLIs and the ablation notebook).

* Figure 1: any ladder metric per ablation step (held-out loss, STS, GLUE), mean ± sd over seeds with the
  individual seeds and ✱ on steps that differ from their parent by more than two standard errors
  (:func:`plot_ablation_steps`).
* Figure 2: pseudo-perplexity against document length (:func:`plot_pseudo_perplexity`).
* Figure 3: throughput against sequence length (:func:`plot_throughput`).
* Training curves of any run from its CSV logs (:func:`plot_curves`, :func:`read_curves`, :func:`final_value`),
  and one metric of several runs side by side (:func:`compare_runs`).

Every function writes a PNG when given a path and returns it (or the figure when no path is given).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; the notebook shows the PNGs or the returned figures
import matplotlib.pyplot as plt  # noqa: E402

from neobert.eval.ladder_stats import LADDER_METRICS  # noqa: E402


def _finish(fig, path: str | Path | None):
    if path is None:
        return fig
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_throughput(rows: Sequence, path: str | Path | None = None):
    """Figure 3: tokens/s against sequence length, one line per model, one panel per (mode, layout)."""
    groups = sorted({(r.mode, r.layout) for r in rows})
    models = list(dict.fromkeys(r.model for r in rows))
    colors = {model: f"C{i}" for i, model in enumerate(models)}  # one colour per model across panels
    lengths = sorted({r.seq_len for r in rows if r.tokens_per_s})
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5.5 * max(1, len(groups)), 4), squeeze=False)
    for ax, (mode, layout) in zip(axes[0], groups):
        for model in models:
            points = sorted((r.seq_len, r.tokens_per_s) for r in rows
                            if (r.mode, r.layout, r.model) == (mode, layout, model) and r.tokens_per_s)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=model, color=colors[model])
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("throughput (tokens/s)")
        ax.set_title(f"{mode}, {layout} batches")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Throughput at the best batch size per model and length")
    return _finish(fig, path)


def plot_pseudo_perplexity(curves: Mapping[str, Sequence[tuple[float, float]]], path: str | Path | None = None):
    """Figure 2: pseudo-perplexity (log scale) against document length; `curves` maps a checkpoint name to
    (bucket length, PPPL) points."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        points = sorted(p for p in points if p[1] is not None)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("document length (tokens, bucket upper bound)")
    ax.set_ylabel("pseudo-perplexity")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Pseudo-perplexity against document length")
    return _finish(fig, path)


def plot_ablation_steps(summary: Sequence[Mapping], metric: str, path: str | Path | None = None,
                        ylabel: str | None = None, title: str | None = None):
    """Figure 1 over seeds: per step the mean ± sd of `metric` with the seeds as small dots beside it; grey:
    reverted, hollow: trained with another tokenizer than the first step (loss-like metrics not comparable),
    ✱: more than two standard errors from the parent.

    `summary`: the output of :func:`neobert.eval.ladder_stats.summarize_ladder`."""
    info = LADDER_METRICS[metric]
    reference_tokenizer = summary[0]["tokenizer"] if summary else None
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(summary) + 2), 4))  # room for "(other tokenizer)" labels
    names = []
    for i, s in enumerate(summary):
        stats = s["metrics"][metric]
        color = "tab:blue" if s["carried_forward"] else "tab:gray"
        other_tokenizer = info.tokenizer_dependent and s["tokenizer"] != reference_tokenizer
        names.append(s["step"].upper() + ("\n(other tokenizer)" if other_tokenizer else ""))
        if stats["mean"] is None:
            # Bottom of the axes: a missing metric has no y value to sit at.
            ax.text(i, 0.02, "n/a", ha="center", va="bottom", fontsize=8, transform=ax.get_xaxis_transform())
            continue
        ax.errorbar(i, stats["mean"], yerr=stats["sd"], fmt="o", color=color, capsize=4, markersize=7,
                    markerfacecolor="white" if other_tokenizer else color)
        ax.scatter([i + 0.2] * stats["n"], stats["values"], s=10, color=color, alpha=0.6, zorder=3)
        if s["vs_parent"].get(metric, {}).get("significant"):
            top = max(stats["values"] + [stats["mean"] + stats["sd"]])  # significant: both sides have a sd
            ax.annotate("✱", (i, top), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=12)
    ax.set_xticks(range(len(summary)), names, fontsize=8)
    ax.set_xlim(-0.6, len(summary) - 0.4)
    ax.set_ylabel(ylabel or f"{info.label} ({'higher' if info.higher_is_better else 'lower'} is better)")
    ax.set_title(title or f"Ablation ladder: {info.label}, mean ± sd over seeds (grey: reverted, ✱: > 2 SE)")
    ax.grid(True, axis="y", alpha=0.3)
    return _finish(fig, path)


def read_curves(csv_paths: str | Path | Iterable[str | Path], keys: Sequence[str]) -> dict[str, dict[int, float]]:
    """key -> {step: value}. Several CSVs (e.g. the versions of a resumed run) are read in order, so a later
    file's value wins for a step both logged."""
    if isinstance(csv_paths, (str, Path)):
        csv_paths = [csv_paths]
    curves: dict[str, dict[int, float]] = {key: {} for key in keys}
    for path in csv_paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                for key in keys:
                    if row.get(key) not in (None, "") and row.get("step") not in (None, ""):
                        curves[key][int(float(row["step"]))] = float(row[key])
    return curves


def final_value(csv_paths, key: str, last_n: int = 1) -> float | None:
    """The mean of the last `last_n` logged values of `key` (None when it was never logged)."""
    points = read_curves(csv_paths, [key])[key]
    last = sorted(points)[-last_n:]
    return sum(points[s] for s in last) / len(last) if last else None


def plot_curves(csv_paths, keys: Sequence[str], out_png: str | Path, hlines: dict[str, float] | None = None,
                title: str | None = None, ylabel: str = "loss (nats)") -> Path:
    """One line per key against the optimizer step, plus labelled horizontal reference lines."""
    curves = read_curves(csv_paths, keys)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, points in curves.items():
        if points:
            steps = sorted(points)
            ax.plot(steps, [points[s] for s in steps], label=key, marker="o" if len(steps) < 20 else None)
    for label, value in (hlines or {}).items():
        ax.axhline(value, color="black", linestyle="--", linewidth=1, label=f"{label} ({value:.2f})")
    return _finish_step_axes(fig, ax, ylabel, title, out_png)


def compare_runs(runs: Mapping[str, str | Path | Iterable[str | Path]], key: str, out_png: str | Path,
                 title: str | None = None, ylabel: str = "loss (nats)") -> Path:
    """One line per run (label -> its CSV logs) of one metric against the optimizer step."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, csv_paths in runs.items():
        points = read_curves(csv_paths, [key])[key]
        if not points:
            raise ValueError(f"run {label!r} never logged {key!r}")
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], label=label)
    return _finish_step_axes(fig, ax, ylabel, title or key, out_png)


def _finish_step_axes(fig, ax, ylabel: str, title: str | None, out_png: str | Path) -> Path:
    """Labels, grid and legend of a plot against the optimizer step, saved to `out_png`."""
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _finish(fig, out_png)


def plot_long_context(curves: Mapping[str, Sequence[tuple[int, float]]], path: str | Path | None = None,
                      chance: Mapping[int, float] | None = None):
    """Long-context retrieval: nDCG@1 (top-1 accuracy) against document length (log2 axis), one line per
    (model, task); `chance` (length -> 1 / candidates) as a dotted line."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, points in curves.items():
        points = sorted(points)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name)
    if chance:
        xs = sorted(chance)
        ax.plot(xs, [chance[x] for x in xs], linestyle=":", color="grey", label="chance (1 / candidates)")
    ax.set_xscale("log", base=2)
    lengths = sorted({x for points in curves.values() for x, _ in points})
    if lengths:
        ax.set_xticks(lengths, [str(x) for x in lengths])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("document length (tokens of the model's tokenizer)")
    ax.set_ylabel("nDCG@1 (top-1 retrieval accuracy)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Long-context retrieval (LongEmbed-style passkey / needle)")
    return _finish(fig, path)
