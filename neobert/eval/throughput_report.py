"""The throughput measurement's reports: its rows as CSV (written and read back) and as Markdown tables in the
layout of paper Table 9 (tokens/s per model and length, achieved FLOP/s or MFU, and speed ratios)."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path
from typing import Callable, Sequence

from neobert.config.throughput import LAYOUTS, MODEL_NAMES, MODES, WINDOWED_MODELS
from neobert.eval.throughput import ThroughputRow

CSV_FIELDS = [f.name for f in dataclasses.fields(ThroughputRow)]


def write_csv(rows: Sequence[ThroughputRow], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(dataclasses.asdict(row))
    return path


def read_csv(path: str | Path) -> list[ThroughputRow]:
    """Reads a CSV written by `write_csv` (for the notebook and for re-plotting)."""
    types = {"batch_size": int, "seq_len": int, "params": int, "tokens_per_s": float, "step_s": float,
             "flops_per_token": float, "achieved_flops": float, "mfu": float, "peak_flops": float,
             "reference_standalone": float}
    rows = []
    with Path(path).open() as handle:
        for raw in csv.DictReader(handle):
            values = {k: (types[k](v) if v not in ("", None) else None) if k in types else v for k, v in raw.items()}
            rows.append(ThroughputRow(**values))
    return rows


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value / scale:,.{digits}f}"


def markdown_table(rows: Sequence[ThroughputRow], reference: str = "neobert") -> str:
    """Table 9 layout per (mode, layout): models as rows, lengths as columns, tokens/s (batch size); then the
    achieved FLOP/s, their share of the peak (a GPU's MFU, or on CPU of the matmul rate measured in the same run),
    and the ratio of `reference` to every other model per length."""
    out = []
    groups = sorted({(r.mode, r.layout) for r in rows}, key=lambda g: (MODES.index(g[0]), LAYOUTS.index(g[1])))
    for mode, layout in groups:
        group = [r for r in rows if (r.mode, r.layout) == (mode, layout)]
        lengths = sorted({r.seq_len for r in group if r.seq_len})
        names = [n for n in MODEL_NAMES if any(r.model == n for r in group)]
        cell = {(r.model, r.seq_len): r for r in group}
        # why a model has no figures; and a windowed row's attention, whose FLOPs are counted dense (WINDOW_NOTE)
        notes = {r.model: r.note for r in group if r.note.startswith("not available") or r.model in WINDOWED_MODELS}
        header = "| model | " + " | ".join(str(n) for n in lengths) + " |"
        rule = "|---|" + "---:|" * len(lengths)

        def section(title: str, models: Sequence[str], text: Callable[[str, int], str], label=lambda n: n) -> None:
            out.extend([f"### {mode}, {layout} batches: {title}\n", header, rule])
            for name in models:
                out.append(f"| {label(name)} | " + " | ".join(text(name, length) for length in lengths) + " |")
            out.append("")

        def measured(model: str, length: int) -> bool:
            return cell.get((model, length)) is not None and cell[(model, length)].tokens_per_s is not None

        def tokens_per_s(name: str, length: int) -> str:
            row = cell.get((name, length))
            return f"{row.tokens_per_s:,.0f} ({row.batch_size})" if measured(name, length) else "n/a"

        def gflops(name: str, length: int) -> str:
            row = cell.get((name, length))
            return _fmt(None if row is None else row.achieved_flops, 1e9, 1)

        def utilisation(name: str, length: int) -> str:
            row = cell.get((name, length))
            return _fmt(None if row is None or row.mfu is None else row.mfu * 100, digits=1)

        def ratio(name: str, length: int) -> str:
            if not (measured(name, length) and measured(reference, length)):
                return "n/a"
            ours, theirs = cell[(reference, length)], cell[(name, length)]
            speed = ours.tokens_per_s / theirs.tokens_per_s
            if name in WINDOWED_MODELS:  # its FLOPs are counted dense: a per-FLOP ratio would mislead
                return f"{speed:.2f}x; n/a"
            per_flop = ours.achieved_flops / theirs.achieved_flops
            return f"{speed:.2f}x; {per_flop:.2f}x"

        section("tokens/s (best batch size)", names, tokens_per_s)
        section("achieved GFLOP/s (tokens/s x FLOPs/token from neobert.eval.flops)", names, gflops)
        peaks = {r.seq_len: r for r in group if r.peak_flops}
        if peaks:
            measured_peak = any(r.peak_source.startswith("measured") for r in peaks.values())
            section("% of the matmul rate measured in this run" if measured_peak else "MFU %", names, utilisation)
            if measured_peak:
                rates = ", ".join(f"{n}: {_fmt(r.peak_flops, 1e9, 1)}" for n, r in sorted(peaks.items()))
                first = next(iter(peaks.values()))
                line = (f"Matmul reference ({first.peak_source}, {group[0].dtype}), GFLOP/s between the timed "
                        f"steps, by length: {rates}")
                if first.reference_standalone:
                    off = [n for n, r in peaks.items() if abs(r.peak_flops / r.reference_standalone - 1) > 0.1]
                    line += f"; standalone before the models: {_fmt(first.reference_standalone, 1e9, 1)}"
                    line += f" (**more than 10% apart at {off}: the machine was not steady**)" if off else ""
                out.extend([line, ""])
        others = [n for n in names if n != reference and any(measured(n, x) and measured(reference, x)
                                                             for x in lengths)]
        if others:
            section(f"ratio {reference} / other (tokens/s; per FLOP)", others, ratio,
                    label=lambda n: f"{reference} / {n}")
        for name, note in notes.items():
            out.append(f"- {name}: {note}")
        if notes:
            out.append("")
    return "\n".join(out)
