"""Configs ship with the package and load by name; every shipped config uses today's keys; moved keys keep
working for one release with a warning naming the new key, and never silently."""

from __future__ import annotations

import importlib
import warnings

import pytest

from neobert.config import ConfigError, config_path, load_config, packaged_config_names
from neobert.config.loader import PACKAGED_CONFIGS
from neobert.config.pretrain import PretrainConfig

# Which schema reads each shipped config.
SCHEMAS = {
    "demo": "neobert.config.pretrain:PretrainConfig",
    "neobert": "neobert.config.pretrain:PretrainConfig",
    "neobert-4096": "neobert.config.pretrain:PretrainConfig",
    "ablations/m": "neobert.config.pretrain:PretrainConfig",
    "ablations/budgets/": "neobert.config.ablations:AblationBudgetConfig",
    "recipes/": "neobert.config.pretrain:PretrainConfig",
    "glue/": "neobert.config.glue:GlueConfig",
    "ner/": "neobert.config.ner:NerConfig",
    "contrastive": "neobert.config.contrastive:ContrastiveConfig",
    "mteb": "neobert.config.mteb:MtebConfig",
}


def schema_for(name: str):
    target = next(value for prefix, value in SCHEMAS.items() if name.startswith(prefix))
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def test_configs_live_inside_the_package():
    assert PACKAGED_CONFIGS.parent.name == "neobert" and (PACKAGED_CONFIGS / "demo.yaml").is_file()
    assert {"demo", "neobert", "neobert-4096", "glue/rte", "contrastive", "mteb", "ablations/m05",
            "ablations/budgets/tiny"} <= set(packaged_config_names())
    assert config_path("mteb_instructions.json").is_file()


@pytest.mark.parametrize("name", packaged_config_names())
def test_every_shipped_config_loads_with_current_keys_and_no_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a shipped config must not use a deprecated key
        config = load_config(schema_for(name), name)
    assert type(config) is schema_for(name)


def test_a_config_is_a_path_or_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # packaged names resolve from any working directory
    assert config_path("neobert") == config_path("neobert.yaml") == PACKAGED_CONFIGS / "neobert.yaml"
    assert config_path("glue/rte") == PACKAGED_CONFIGS / "glue" / "rte.yaml"
    mine = tmp_path / "neobert.yaml"  # a file in the working directory wins over the packaged name
    mine.write_text("trainer:\n  max_steps: 7\n")
    assert config_path("neobert.yaml").resolve() == mine
    assert load_config(PretrainConfig, "neobert.yaml").trainer.max_steps == 7
    assert load_config(PretrainConfig, "neobert").trainer.max_steps == 1_000_000
    with pytest.raises(ConfigError, match="'nosuch' does not exist.*packaged: .*glue/rte"):
        config_path("nosuch")


def test_a_moved_key_works_with_a_warning_naming_the_new_key(tmp_path):
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text("run_dir: runs/x\ntrainer:\n  compile: true\n  progress_bar: false\n"
                        "  val_check_interval: 7\n")
    with pytest.warns(FutureWarning) as caught:
        config = load_config(PretrainConfig, old_yaml, ["trainer.masked_only_logits=false",
                                                        "trainer.log_every_n_steps=3"])
    messages = " ".join(str(w.message) for w in caught)
    for old, new in [("run_dir", "output_dir"), ("trainer.compile", "model.compile"),
                     ("trainer.progress_bar", "logging.progress_bar"),
                     ("trainer.val_check_interval", "trainer.eval_every_n_steps"),
                     ("trainer.masked_only_logits", "model.masked_only_logits"),
                     ("trainer.log_every_n_steps", "logging.log_every_n_steps")]:
        assert f"'{old}' is deprecated" in messages and f"use '{new}'" in messages
    assert config.output_dir == "runs/x" and config.model.compile and not config.logging.progress_bar
    assert config.trainer.eval_every_n_steps == 7 and not config.model.masked_only_logits
    assert config.logging.log_every_n_steps == 3


def test_a_moved_key_is_never_silently_mixed_with_its_new_name(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("run_dir: a\noutput_dir: b\n")
    with pytest.raises(ConfigError, match="both 'run_dir' \\(deprecated\\) and 'output_dir'"):
        load_config(PretrainConfig, both)


def test_validation_runs_at_load_and_names_the_key():
    with pytest.raises(ConfigError, match="trainer.devices"):
        load_config(PretrainConfig, None, ["trainer.devices=0"])
    with pytest.raises(ConfigError, match="logging.loggers"):
        load_config(PretrainConfig, None, ["logging.loggers=[csv,wandb]"])
    with pytest.raises(ConfigError, match="scheduler.warmup_fraction"):
        load_config(PretrainConfig, None, ["scheduler.warmup_fraction=1.5"])
