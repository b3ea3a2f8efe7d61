"""The ablation ladder over seeds: mean ± sd per step, the difference to the parent in standard errors, the Markdown
table and Figure 1 with error bars, on hand-computed synthetic runs."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pytest

from neobert.eval.ladder_stats import LADDER_METRICS, significant_steps, summarize_ladder, summary_markdown
from neobert.eval.plots import plot_ablation_steps

CORPUS_NOTE = "data: the offline demo corpus"
BUDGET_NOTE = "short budget"
BPE_NOTE = "BPE trained offline"


def _row(step, parent, seed, heldout_loss, sts_tuned, tokenizer="bert", carried_forward=True, notes=(), **metrics):
    return {"step": step, "parent": parent, "title": f"change {step}", "carried_forward": carried_forward,
            "seed": seed, "tokenizer": tokenizer, "notes": [CORPUS_NOTE, *notes], "heldout_loss": heldout_loss,
            "heldout_accuracy": None, "pseudo_perplexity": metrics.get("pseudo_perplexity"), "train_loss": None,
            "sts_zero_shot": metrics.get("sts_zero_shot"), "sts_tuned": sts_tuned, "glue_score": None}


# m01 is clearly better than m00, m02 (reverted) is within noise of m01, m03 switches tokenizer, m04 has one seed.
# Seeds are listed out of order: values must come back ordered by seed.
ROWS = [
    _row("m00", None, 2, 3.2, 0.54, pseudo_perplexity=24.0),
    _row("m00", None, 0, 3.0, 0.50, pseudo_perplexity=20.0, sts_zero_shot=0.30),
    _row("m00", None, 1, 3.1, 0.52, pseudo_perplexity=22.0, sts_zero_shot=0.34),
    _row("m01", "m00", 0, 2.5, 0.60, pseudo_perplexity=15.0),
    _row("m01", "m00", 1, 2.6, 0.62, pseudo_perplexity=16.0),
    _row("m01", "m00", 2, 2.7, 0.64, pseudo_perplexity=17.0),
    _row("m02", "m01", 0, 2.52, 0.61, carried_forward=False, notes=[BUDGET_NOTE]),
    _row("m02", "m01", 1, 2.72, 0.63, carried_forward=False, notes=[BUDGET_NOTE]),
    _row("m02", "m01", 2, 2.62, 0.65, carried_forward=False, notes=[BUDGET_NOTE]),
    _row("m03", "m01", 0, 4.0, 0.70, tokenizer="bpe", notes=[BUDGET_NOTE]),
    _row("m03", "m01", 1, 4.1, 0.72, tokenizer="bpe", notes=[BPE_NOTE]),
    _row("m03", "m01", 2, 4.2, 0.74, tokenizer="bpe"),
    _row("m04", "m03", 0, 3.9, 0.73, tokenizer="bpe"),
]
SE_THREE_SEEDS_SD_01 = math.sqrt(0.1 ** 2 / 3 + 0.1 ** 2 / 3)  # heldout_loss: sd 0.1 on both sides, n = 3
SE_THREE_SEEDS_SD_002 = math.sqrt(0.02 ** 2 / 3 + 0.02 ** 2 / 3)  # sts_tuned: sd 0.02 on both sides, n = 3


@pytest.fixture
def summary():
    return summarize_ladder(ROWS)


def test_metrics_table_marks_only_the_losses_as_tokenizer_dependent():
    dependent = [name for name, info in LADDER_METRICS.items() if info.tokenizer_dependent]
    assert dependent == ["heldout_loss", "heldout_accuracy", "pseudo_perplexity", "train_loss"]
    assert LADDER_METRICS["heldout_loss"] == ("held-out MLM loss (15%)", False, True)
    assert LADDER_METRICS["sts_tuned"].higher_is_better


def test_mean_sd_and_values_per_step(summary):
    assert [s["step"] for s in summary] == ["m00", "m01", "m02", "m03", "m04"]
    m00 = summary[0]
    assert m00["seeds"] == [0, 1, 2]
    assert (m00["parent"], m00["title"], m00["carried_forward"], m00["tokenizer"]) == (None, "change m00", True, "bert")
    loss = m00["metrics"]["heldout_loss"]
    assert loss["values"] == [3.0, 3.1, 3.2]
    assert (loss["mean"], loss["sd"], loss["n"]) == (pytest.approx(3.1), pytest.approx(0.1), 3)
    zero_shot = m00["metrics"]["sts_zero_shot"]  # missing at seed 2
    assert (zero_shot["values"], zero_shot["n"]) == ([0.30, 0.34], 2)
    assert (zero_shot["mean"], zero_shot["sd"]) == (pytest.approx(0.32), pytest.approx(math.sqrt(0.0008)))
    assert summary[2]["metrics"]["heldout_loss"]["mean"] == pytest.approx(2.62)
    assert summary[2]["metrics"]["pseudo_perplexity"] == {"mean": None, "sd": None, "n": 0, "values": []}
    m04 = summary[4]["metrics"]["heldout_loss"]
    assert (m04["mean"], m04["sd"], m04["n"]) == (pytest.approx(3.9), None, 1)
    assert summary[3]["notes"] == [CORPUS_NOTE, BUDGET_NOTE, BPE_NOTE]


def test_difference_to_parent_in_standard_errors(summary):
    m00, m01, m02, m03, m04 = summary
    assert m00["vs_parent"] == {}
    loss = m01["vs_parent"]["heldout_loss"]
    assert loss == {"diff": pytest.approx(-0.5), "se": pytest.approx(SE_THREE_SEEDS_SD_01), "significant": True,
                    "comparable": True}
    within_noise = m02["vs_parent"]["heldout_loss"]
    assert within_noise == {"diff": pytest.approx(0.02), "se": pytest.approx(SE_THREE_SEEDS_SD_01),
                            "significant": False, "comparable": True}
    assert m02["vs_parent"]["sts_tuned"]["diff"] == pytest.approx(0.01)
    assert m02["vs_parent"]["sts_tuned"]["significant"] is False
    # m03 trains another tokenizer than m01: its loss is not comparable, its STS score is.
    assert m03["vs_parent"]["heldout_loss"] == {"diff": None, "se": None, "significant": None, "comparable": False}
    assert m03["vs_parent"]["sts_tuned"] == {"diff": pytest.approx(0.10), "se": pytest.approx(SE_THREE_SEEDS_SD_002),
                                             "significant": True, "comparable": True}
    # One seed: a difference but no standard error.
    assert m04["vs_parent"]["heldout_loss"] == {"diff": pytest.approx(-0.2), "se": None, "significant": None,
                                                "comparable": True}
    assert significant_steps(summary, "heldout_loss") == ["m01"]
    assert significant_steps(summary, "sts_tuned") == ["m01", "m03"]


def test_inconsistent_or_unknown_input_is_refused():
    with pytest.raises(ValueError, match="same seed"):
        summarize_ladder([ROWS[0], ROWS[0]])
    with pytest.raises(ValueError, match="disagree on 'tokenizer'"):
        summarize_ladder([ROWS[0], {**ROWS[1], "tokenizer": "bpe"}])
    with pytest.raises(ValueError, match="unknown ladder metrics"):
        summarize_ladder(ROWS, metrics=("mlm_loss",))
    with pytest.raises(ValueError, match="unknown ladder metric"):
        significant_steps(summarize_ladder(ROWS), "mlm_loss")


def test_summary_markdown(summary):
    text = summary_markdown(summary, metrics=("heldout_loss", "pseudo_perplexity", "sts_zero_shot", "sts_tuned"))
    lines = text.splitlines()
    assert lines[0] == ("| step | change | parent | kept | seeds | held-out MLM loss (15%) | Δ vs parent | "
                        "pseudo-perplexity | Δ vs parent | STS-B Spearman (zero-shot) | Δ vs parent | "
                        "STS-B Spearman (contrastive fine-tune) | Δ vs parent |")
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:7]}
    assert rows["M00"] == ("| M00 | change m00 |  | yes | 0, 1, 2 | 3.100 ± 0.100 |  | 22.0 ± 2.0 |  | "
                           "0.320 ± 0.028 (n=2) |  | 0.520 ± 0.020 |  |")
    assert "| 2.600 ± 0.100 | -0.500 (6.1 SE) ✱ |" in rows["M01"]
    assert "| M02 | change m02 | M01 | no |" in rows["M02"]
    assert "| 2.620 ± 0.100 | +0.020 (0.2 SE) |" in rows["M02"]
    assert "✱" not in rows["M02"]
    assert "| 4.100 ± 0.100 | not comparable (tokenizer) |" in rows["M03"]
    assert "| 0.720 ± 0.020 | +0.100 (6.1 SE) ✱ |" in rows["M03"]
    assert "| 3.900 | -0.200 | n/a | n/a |" in rows["M04"]
    assert any("two standard errors" in line and "sample standard deviation" in line for line in lines)
    notes = lines[lines.index("Notes:") + 1:]
    assert notes == [f"- all steps: {CORPUS_NOTE}", f"- M02, M03: {BUDGET_NOTE}", f"- M03: {BPE_NOTE}"]


def test_plot_ablation_steps_writes_a_png_and_marks_other_tokenizers(summary, tmp_path):
    for metric in ("heldout_loss", "pseudo_perplexity"):  # pseudo-perplexity is None for m02..m04
        out = plot_ablation_steps(summary, metric, tmp_path / f"{metric}.png")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = plot_ablation_steps(summary, "pseudo_perplexity")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["M00", "M01", "M02", "M03\n(other tokenizer)",
                                                            "M04\n(other tokenizer)"]
    assert [t.get_text() for t in ax.texts] == ["✱", "n/a", "n/a", "n/a"]  # m01 beats m00 on pseudo-perplexity
    assert ax.get_ylabel() == "pseudo-perplexity (lower is better)"
    plt.close(fig)
    fig = plot_ablation_steps(summary, "sts_tuned")  # tokenizer independent: no step marked
    assert "(other tokenizer)" not in " ".join(t.get_text() for t in fig.axes[0].get_xticklabels())
    plt.close(fig)
