"""The throughput job (paper Figure 3 and Table 9; docs/ablations.md): measure every model at every length, then
write throughput.csv, throughput.md (the Table 9 layout) and throughput.png (the Figure 3 layout) under
`output_dir`."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from neobert.config.throughput import ThroughputConfig
from neobert.eval.plots import plot_throughput
from neobert.eval.throughput import ThroughputRow, run_throughput
from neobert.eval.throughput_report import markdown_table, write_csv
from neobert.layout import THROUGHPUT_CSV, THROUGHPUT_MD, THROUGHPUT_PLOT


def run_throughput_job(config: ThroughputConfig) -> dict[str, Path]:
    """Measures, writes the reports and returns their paths ({"csv", "markdown", "plot"})."""
    return write_reports(run_throughput(config), config.output_dir)


def write_reports(rows: Sequence[ThroughputRow], output_dir: str | Path) -> dict[str, Path]:
    """CSV, Markdown table and the Figure 3 plot under `output_dir`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_csv(rows, output_dir / THROUGHPUT_CSV)}
    paths["markdown"] = output_dir / THROUGHPUT_MD
    paths["markdown"].write_text(markdown_table(rows) + "\n")
    paths["plot"] = plot_throughput(rows, output_dir / THROUGHPUT_PLOT)
    return paths
