"""experiments.compare_runs: runs side by side (plots per metric, final values, throughput ratios)."""

from __future__ import annotations

import pytest

from experiments.compare_runs import main
from neobert.errors import UserInputError


def _run(root, name, rows, versions=1):
    """A run directory whose CSV logs hold `rows` (step, train/loss, tokens/s, val/loss or ''), split over versions
    as a resumed run writes them."""
    run = root / name
    per_version = -(-len(rows) // versions)
    for version in range(versions):
        log = run / "logs" / f"version_{version}" / "metrics.csv"
        log.parent.mkdir(parents=True)
        chunk = rows[version * per_version:(version + 1) * per_version]
        log.write_text("step,train/loss,train/tokens_per_sec,val/loss\n"
                       + "".join(f"{s},{loss},{speed},{val}\n" for s, loss, speed, val in chunk))
    return run


def test_two_runs_give_plots_final_losses_and_the_speed_ratio(tmp_path):
    fp32 = _run(tmp_path, "fp32", [(0, 9.0, 50.0, ""), (5, 8.0, 100.0, ""), (9, 7.0, 110.0, 7.5)])
    bf16 = _run(tmp_path, "bf16", [(0, 9.0, 10.0, ""), (5, 8.2, 200.0, ""), (9, 7.2, 240.0, 7.6)], versions=2)
    paths = main([f"fp32={fp32}", f"bf16-mixed={bf16}", "--output-dir", str(tmp_path / "cmp")])
    for key in ("train/loss", "val/loss"):
        assert paths[key].name == key.replace("/", "_") + ".png"
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = paths["markdown"].read_text().splitlines()
    # train loss: the mean of the last 5 logged steps; val loss: the last; tokens/s: median without the first
    assert table[2] == "| fp32 | 8.0000 | 7.5000 | 105 | 1.00x |"
    assert table[3] == "| bf16-mixed | 8.1333 | 7.6000 | 220 | 2.10x |"


def test_bad_runs_are_named(tmp_path):
    fp32 = _run(tmp_path, "fp32", [(0, 9.0, 50.0, "")])
    with pytest.raises(UserInputError, match="LABEL=OUTPUT_DIR"):
        main([str(fp32), f"b={fp32}", "--output-dir", str(tmp_path)])
    with pytest.raises(UserInputError, match="at least two runs"):
        main([f"a={fp32}", "--output-dir", str(tmp_path)])
    with pytest.raises(UserInputError, match="run 'b': no metrics.csv"):
        main([f"a={fp32}", f"b={tmp_path / 'nothing'}", "--output-dir", str(tmp_path)])
