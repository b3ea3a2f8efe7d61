"""Plots drawn from CSV logs: one metric of several runs side by side."""

from __future__ import annotations

import pytest

from neobert.eval.plots import compare_runs, read_curves


def _log(path, rows):
    path.write_text("step,train/loss,train/lr\n" + "".join(f"{s},{loss},{lr}\n" for s, loss, lr in rows))
    return path


def test_compare_runs_draws_each_run_and_names_a_run_without_the_metric(tmp_path):
    fp32 = _log(tmp_path / "a.csv", [(0, 9.0, 1e-4), (1, 8.0, 1e-4)])
    bf16 = _log(tmp_path / "b.csv", [(0, 9.1, 1e-4), (1, 8.2, 1e-4)])
    out = compare_runs({"fp32": fp32, "bf16-mixed": bf16}, "train/loss", tmp_path / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_curves(bf16, ["train/loss"])["train/loss"] == {0: 9.1, 1: 8.2}
    with pytest.raises(ValueError, match="'empty' never logged 'train/loss'"):
        compare_runs({"empty": _log(tmp_path / "c.csv", [])}, "train/loss", tmp_path / "none.png")
