"""Runs side by side (e.g. bf16-mixed against fp32 on the same config): one plot per metric, every run's curve
against the optimizer step, and a Markdown table of each run's final values and median training throughput, with
ratios to the first run."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Mapping, Sequence

from neobert.errors import UserInputError
from neobert.eval.plots import compare_runs, final_value, read_curves
from neobert.layout import COMPARISON_MD, comparison_plot, metrics_csvs

DEFAULT_KEYS = ("train/loss", "val/loss")
SPEED_KEY = "train/tokens_per_sec"


def median_after_first(points: Mapping[int, float]) -> float | None:
    """The median of a logged rate without its first interval (start-up: data workers, kernel selection)."""
    values = [points[step] for step in sorted(points)][1:]
    return statistics.median(values) if values else None


def compare_runs_job(runs: Mapping[str, str | Path], output_dir: str | Path, keys: Sequence[str] = DEFAULT_KEYS,
                     last_n: int = 5) -> dict[str, Path]:
    """`runs`: label -> a run's output_dir (the first run is the reference of the ratios). Writes one plot per key
    and comparison.md under `output_dir`; returns their paths."""
    if len(runs) < 2:
        raise UserInputError(f"compare at least two runs, got {len(runs)}")
    logs = {}
    for label, run_dir in runs.items():
        logs[label] = metrics_csvs(run_dir)
        if not logs[label]:
            raise UserInputError(f"run {label!r}: no metrics.csv under {Path(run_dir) / 'logs'} (not a run directory?)")
    output_dir = Path(output_dir)
    paths = {key: compare_runs(logs, key, output_dir / comparison_plot(key)) for key in keys}

    reference = next(iter(runs))
    speeds = {label: median_after_first(read_curves(csvs, [SPEED_KEY])[SPEED_KEY]) for label, csvs in logs.items()}
    averaged = {key: last_n if key.startswith("train") else 1 for key in keys}  # validation: the last value
    header = ["run", *(f"final {key} (mean of last {averaged[key]})" for key in keys),
              "median tokens/s", f"tokens/s vs {reference}"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for label, csvs in logs.items():
        finals = [final_value(csvs, key, averaged[key]) for key in keys]
        speed, base = speeds[label], speeds[reference]
        cells = [label, *("n/a" if v is None else f"{v:.4f}" for v in finals),
                 "n/a" if speed is None else f"{speed:,.0f}",
                 "n/a" if speed is None or not base else f"{speed / base:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    paths["markdown"] = output_dir / COMPARISON_MD
    paths["markdown"].write_text("\n".join(lines) + "\n")
    return paths
