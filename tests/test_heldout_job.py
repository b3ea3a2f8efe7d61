"""experiments.heldout: exported models scored alike on each source's held-out documents, one table, groups
averaged (the phased-vs-single comparison of docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest
from test_pretrain import tiny_config

from experiments.heldout import main
from neobert.errors import UserInputError
from neobert.eval.heldout import heldout_mlm_loss
from neobert.eval.pseudo_perplexity import load_model_and_tokenizer
from neobert.jobs.pretrain import run_pretraining


def test_models_are_scored_per_source_and_averaged_per_group(tmp_path):
    export = run_pretraining(tiny_config(tmp_path, "trainer.max_steps=2", "data.validation_docs=8"))
    corpus = tmp_path / "corpus.jsonl"
    paths = main([f"g/0={export}", f"g/1={export}", "--source", f"demo={corpus}", "--source", f"again={corpus}",
                  "--documents", "8", "--max-length", "32", "--output-dir", str(tmp_path / "out")])
    scores = json.loads(paths["json"].read_text())
    model, tokenizer = load_model_and_tokenizer(str(export))
    expected = heldout_mlm_loss(model, tokenizer, str(corpus), 8, 32, 0.2)["loss"]
    assert scores["g/0"] == scores["g/1"] == pytest.approx({"demo": expected, "again": expected, "all": expected})
    table = paths["markdown"].read_text()
    assert "| g/0 | " in table and f"| g (2) | {expected:.4f} (0.0000) | " in table
    with pytest.raises(UserInputError, match="expected distinct NAME=CORPUS"):
        main([f"g/0={export}", "--source", "nocorpus", "--output-dir", str(tmp_path / "x")])
