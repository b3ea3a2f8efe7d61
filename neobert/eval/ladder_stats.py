"""The ablation ladder (paper Figure 1) over several seeds: per step the mean and sample sd of each metric, and its
difference to the parent step in standard errors, so a step is called better or worse only when the difference is
larger than the seed-to-seed noise.

Input: one row dict per (step, seed) run with `step`, `parent`, `title`, `carried_forward`, `seed`, `tokenizer`,
`notes` and the metrics of :data:`LADDER_METRICS` (None when not measured)."""

from __future__ import annotations

import math
import statistics
from typing import Mapping, NamedTuple, Sequence


class LadderMetric(NamedTuple):
    label: str
    higher_is_better: bool
    tokenizer_dependent: bool  # per-token losses of two vocabularies measure different things: not comparable


LADDER_METRICS: dict[str, LadderMetric] = {
    "heldout_loss": LadderMetric("held-out MLM loss (15%)", False, True),
    "heldout_accuracy": LadderMetric("held-out MLM accuracy (15%)", True, True),
    "pseudo_perplexity": LadderMetric("pseudo-perplexity", False, True),
    "train_loss": LadderMetric("final train loss", False, True),
    "sts_zero_shot": LadderMetric("STS-B Spearman (zero-shot)", True, False),
    "sts_tuned": LadderMetric("STS-B Spearman (contrastive fine-tune)", True, False),
    "glue_score": LadderMetric("GLUE score", True, False),
}

_FORMATS = {"pseudo_perplexity": ".1f"}  # everything else is a loss, an accuracy or a correlation: ".3f"


def summarize_ladder(rows: Sequence[Mapping], metrics: Sequence[str] = tuple(LADDER_METRICS)) -> list[dict]:
    """One dict per step (first-seen order) with the mean, sample sd, n and seed-ordered values of each metric, and
    `vs_parent`: the difference of the means to the parent step with its standard error ({} without the parent)."""
    unknown = [name for name in metrics if name not in LADDER_METRICS]
    if unknown:
        raise ValueError(f"unknown ladder metrics {unknown}; known: {list(LADDER_METRICS)}")
    runs_of: dict[str, list[Mapping]] = {}
    for row in rows:
        runs_of.setdefault(row["step"], []).append(row)
    summary = [_summarize_step(step, runs, metrics) for step, runs in runs_of.items()]
    by_step = {s["step"]: s for s in summary}
    for s in summary:
        parent = by_step.get(s["parent"])
        s["vs_parent"] = {} if parent is None else {name: _vs_parent(s, parent, name) for name in metrics}
    return summary


def _summarize_step(step: str, runs: list[Mapping], metrics: Sequence[str]) -> dict:
    seeds = sorted(r["seed"] for r in runs)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"step {step!r} has several runs with the same seed: {seeds}")
    first = runs[0]
    for key in ("parent", "tokenizer", "carried_forward"):
        if len({r[key] for r in runs}) > 1:
            raise ValueError(f"the runs of step {step!r} disagree on {key!r}: {sorted({str(r[key]) for r in runs})}")
    notes = list(dict.fromkeys(note for r in runs for note in r.get("notes") or []))  # first-seen (row) order
    runs = sorted(runs, key=lambda r: r["seed"])
    return {"step": step, "parent": first["parent"], "title": first["title"],
            "carried_forward": first["carried_forward"], "tokenizer": first["tokenizer"], "seeds": seeds,
            "notes": notes, "metrics": {name: _stats([r.get(name) for r in runs]) for name in metrics}}


def _stats(values: list[float | None]) -> dict:
    values = [float(v) for v in values if v is not None]
    return {"mean": statistics.fmean(values) if values else None,
            "sd": statistics.stdev(values) if len(values) >= 2 else None,  # sample sd (ddof=1)
            "n": len(values), "values": values}


def _vs_parent(step: dict, parent: dict, name: str) -> dict:
    if LADDER_METRICS[name].tokenizer_dependent and step["tokenizer"] != parent["tokenizer"]:
        return {"diff": None, "se": None, "significant": None, "comparable": False}
    own, ref = step["metrics"][name], parent["metrics"][name]
    diff = None if own["mean"] is None or ref["mean"] is None else own["mean"] - ref["mean"]
    # Welch's standard error of a difference of two means; needs a sd on both sides.
    se = None if own["sd"] is None or ref["sd"] is None else \
        math.sqrt(own["sd"] ** 2 / own["n"] + ref["sd"] ** 2 / ref["n"])
    significant = None if se is None else abs(diff) > 2 * se
    return {"diff": diff, "se": se, "significant": significant, "comparable": True}


def significant_steps(summary: Sequence[Mapping], metric: str) -> list[str]:
    """The steps whose mean on `metric` differs from their parent's by more than two standard errors."""
    if metric not in LADDER_METRICS:
        raise ValueError(f"unknown ladder metric {metric!r}; known: {list(LADDER_METRICS)}")
    return [s["step"] for s in summary if s["vs_parent"].get(metric, {}).get("significant")]


def summary_markdown(summary: Sequence[Mapping],
                     metrics: Sequence[str] = ("heldout_loss", "pseudo_perplexity", "sts_zero_shot",
                                               "sts_tuned")) -> str:
    """A Markdown table: per step the mean ± sd over seeds of each metric and its difference to the parent, then a
    legend and the notes with the steps they apply to."""
    header = "| step | change | parent | kept | seeds | " + \
        " | ".join(f"{LADDER_METRICS[name].label} | Δ vs parent" for name in metrics) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for s in summary:
        cells = [s["step"].upper(), s["title"], (s["parent"] or "").upper(), "yes" if s["carried_forward"] else "no",
                 ", ".join(str(seed) for seed in s["seeds"])]
        for name in metrics:
            cells += [_mean_sd_cell(s["metrics"][name], len(s["seeds"]), _FORMATS.get(name, ".3f")),
                      _diff_cell(s["vs_parent"].get(name), _FORMATS.get(name, ".3f"))]
        lines.append("| " + " | ".join(cells) + " |")
    directions = "; ".join(f"{LADDER_METRICS[name].label}: "
                           f"{'higher' if LADDER_METRICS[name].higher_is_better else 'lower'} is better"
                           for name in metrics)
    lines += ["", "± : sample standard deviation over seeds (n-1). Δ vs parent: difference of the means, with its "
              "size in standard errors SE = sqrt(sd²/n + sd_parent²/n_parent); ✱: difference larger than two "
              "standard errors. Loss-like metrics are not comparable across tokenizers. " + directions + "."]
    steps_of: dict[str, list[str]] = {}
    for s in summary:
        for note in s["notes"]:
            steps_of.setdefault(note, []).append(s["step"].upper())
    if steps_of:
        lines += ["", "Notes:"]
        for note, steps in steps_of.items():
            where = "all steps" if len(steps) == len(summary) > 1 else ", ".join(steps)
            lines.append(f"- {where}: {note}")
    return "\n".join(lines)


def _mean_sd_cell(stats: Mapping, n_seeds: int, fmt: str) -> str:
    if stats["mean"] is None:
        return "n/a"
    cell = f"{stats['mean']:{fmt}}" if stats["sd"] is None else f"{stats['mean']:{fmt}} ± {stats['sd']:{fmt}}"
    # A metric missing at some seeds averages fewer runs than the seeds column says.
    return cell if stats["n"] == n_seeds else f"{cell} (n={stats['n']})"


def _diff_cell(vs_parent: Mapping | None, fmt: str) -> str:
    if vs_parent is None:
        return ""
    if not vs_parent["comparable"]:
        return "not comparable (tokenizer)"
    if vs_parent["diff"] is None:
        return "n/a"
    cell = f"{vs_parent['diff']:+{fmt}}"
    if vs_parent["se"]:  # no SE (a single seed) or a zero SE (identical seeds): no size in SE to show
        cell += f" ({abs(vs_parent['diff']) / vs_parent['se']:.1f} SE)"
    return cell + " ✱" if vs_parent["significant"] else cell
