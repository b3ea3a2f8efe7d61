"""The notebook's probes on tiny random NeoBERT exports: the paraphrase-vs-unrelated similarity gap, the choice of
one run per ladder step, fill-mask and gap tables across steps, and Figure 2's pseudo-perplexity labelled by step."""

from __future__ import annotations

import json
import re

import pytest
import torch

from neobert.data.tokenizer import load_tokenizer
from neobert.eval.probes import fill_mask, fill_mask_by_step, ladder_probe_runs, paraphrase_gap, paraphrase_gap_by_step
from neobert.jobs.pseudo_perplexity import ladder_pseudo_perplexity
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

SENTENCES = ("The function returns a list.", "Install the package with pip.", "It rained all week.")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, str]:
    """Two tiny random exports (MLM head and tokenizer, as the ladder writes them) with different weights; a
    max_length that is not a power of two, so Figure 2's default length buckets end with an odd one."""
    directories = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        directory = tmp_path_factory.mktemp(f"export{seed}")
        NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", max_length=100)).save_pretrained(
            directory, tokenizer=load_tokenizer(max_length=100))
        directories[f"m0{seed}"] = str(directory)
    return directories


def test_paraphrase_gap_of_identical_pairs_is_positive(exports):
    scores = paraphrase_gap(exports["m00"], [(s, s) for s in SENTENCES])
    assert scores["paraphrase"] == pytest.approx(1.0, abs=1e-5)
    assert scores["unrelated"] < 1.0 - 1e-4
    assert scores["gap"] == pytest.approx(scores["paraphrase"] - scores["unrelated"]) and scores["gap"] > 0


def test_paraphrase_gap_mismatches_first_i_with_second_i_plus_1(exports):
    a, b, c = SENTENCES
    # The second sentence of pair i + 1 repeats the first of pair i: every mismatched pair is identical.
    scores = paraphrase_gap(exports["m00"], [(a, c), (b, a), (c, b)])
    assert scores["unrelated"] == pytest.approx(1.0, abs=1e-5)
    assert scores["paraphrase"] < 1.0 - 1e-4 and scores["gap"] < 0
    with pytest.raises(ValueError, match="at least two pairs"):
        paraphrase_gap(exports["m00"], [(a, a)])


def test_ladder_probe_runs_picks_one_seed_per_step_in_order_of_appearance():
    # Seed by seed, as the ladder writes results.json; m04 before m03 to tell appearance order from sorting.
    rows = [{"step": step, "seed": seed, "export_dir": f"{step}/seed{seed}/export"}
            for seed in (2, 1) for step in ("m04", "m03")] + [{"step": "m04", "seed": 3, "export_dir": "m04/seed3"}]
    assert ladder_probe_runs(rows) == {"m04": "m04/seed1/export", "m03": "m03/seed1/export"}
    assert list(ladder_probe_runs(rows)) == ["m04", "m03"]
    assert ladder_probe_runs(rows, seed=2) == {"m04": "m04/seed2/export", "m03": "m03/seed2/export"}
    with pytest.raises(ValueError, match="'m03' has no run at seed 3"):
        ladder_probe_runs(rows, seed=3)


def test_fill_mask_by_step_has_top_k_predictions_per_step_and_slot(exports):
    texts = ["The [MASK] statement defines a function.", "A [MASK] is not a [MASK]."]
    rows = fill_mask_by_step(exports, texts, top_k=3)
    assert [(r["step"], r["text"], r["slot"]) for r in rows] == [
        (step, text, slot) for step in ("m00", "m01") for text, slots in zip(texts, (1, 2)) for slot in range(slots)]
    for row in rows:
        probabilities = [float(p) for p in re.findall(r"' \(([0-9.e+-]+)\)", row["predictions"])]
        assert len(probabilities) == 3 and all(0 < p <= 1 for p in probabilities)
    # The same predictions as fill_mask on each step's own export (not one model for every step).
    for step, export in exports.items():
        expected = fill_mask(export, texts[1], top_k=3)[1]
        row = next(r for r in rows if (r["step"], r["text"], r["slot"]) == (step, texts[1], 1))
        assert row["predictions"] == ", ".join(f"{token!r} ({p:.2g})" for token, p in expected)


def test_paraphrase_gap_by_step_scores_each_steps_export(exports):
    pairs = [(s, s) for s in SENTENCES]
    rows = paraphrase_gap_by_step(exports, pairs)
    assert [r["step"] for r in rows] == ["m00", "m01"]
    for row in rows:
        assert row == pytest.approx({"step": row["step"], **paraphrase_gap(exports[row["step"]], pairs)})
    assert rows[0]["unrelated"] != pytest.approx(rows[1]["unrelated"])


def test_ladder_pseudo_perplexity_scores_one_run_per_step(exports, tmp_path):
    corpus = tmp_path / "heldout.jsonl"
    documents = ["word " * n for n in (10, 12, 25, 28, 50, 60, 100, 110)]
    corpus.write_text("".join(json.dumps({"content": text}) + "\n" for text in documents))
    rows = [{"step": "m00", "seed": seed, "export_dir": exports[f"m0{seed}"]} for seed in (1, 0)] + \
        [{"step": "m03", "seed": 0, "export_dir": exports["m01"]}]
    buckets = ladder_pseudo_perplexity(rows, corpus, docs_per_bucket=1)
    assert [b.model for b in buckets] == ["m00"] * 4 + ["m03"] * 4
    # Default edges: powers of two, then the checkpoints' max_length; one run per step, so one document a bucket.
    assert [b.bucket_high for b in buckets[:4]] == [16, 32, 64, 100] and {b.documents for b in buckets} == {1}
    # m00 is its smallest seed's run (exports m00), m03 the other export: different weights, different scores.
    seed1 = ladder_pseudo_perplexity(rows, corpus, bucket_edges=[16], docs_per_bucket=1, seed=1, steps=["m00"])
    assert [b.model for b in seed1] == ["m00"] and seed1[0].pppl != pytest.approx(buckets[0].pppl)
    with pytest.raises(FileNotFoundError, match="heldout.documents"):
        ladder_pseudo_perplexity(rows, tmp_path / "missing.jsonl")
