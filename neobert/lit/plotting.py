"""Training curves from Lightning's CSV logs, as a PNG (any run, any metric)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterable, Sequence


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = read_curves(csv_paths, keys)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, points in curves.items():
        if points:
            steps = sorted(points)
            ax.plot(steps, [points[s] for s in steps], label=key, marker="o" if len(steps) < 20 else None)
    for label, value in (hlines or {}).items():
        ax.axhline(value, color="black", linestyle="--", linewidth=1, label=f"{label} ({value:.2f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
