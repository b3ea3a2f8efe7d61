"""`model_overrides.<field>`: the NeoBERTConfig fields a run changes, one key in every job whose `model` is a name or
path (GLUE, NER, contrastive, mining, MTEB, throughput), as `model.overrides.<field>` is pretraining's. The earlier
spellings (a top-level `kernels`, throughput's `neobert_overrides`) still work for one release with a warning naming
the new key; a job that loads a trained model takes only the fields safe at load (`kernels`), and refuses another
or a misspelt one naming `model_overrides.<field>`."""

from __future__ import annotations

import warnings

import pytest

from neobert.config import ConfigError, load_config
from neobert.config.contrastive import ContrastiveConfig
from neobert.config.glue import GlueConfig
from neobert.config.mining import MiningConfig
from neobert.config.mteb import MtebConfig
from neobert.config.ner import NerConfig
from neobert.config.throughput import ThroughputConfig

LOADED_MODEL_SCHEMAS = [GlueConfig, NerConfig, ContrastiveConfig, MiningConfig, MtebConfig]
SCHEMAS = [*LOADED_MODEL_SCHEMAS, ThroughputConfig]


def required(schema, tmp_path) -> list[str]:
    """The keys a schema cannot load without (mining: its input and output files)."""
    if schema is not MiningConfig:
        return []
    (tmp_path / "pairs.jsonl").write_text('{"query": "q", "positive": "p"}\n')
    return [f"input={tmp_path / 'pairs.jsonl'}", f"output={tmp_path / 'mined.jsonl'}"]


def old_key(schema) -> str:
    return "neobert_overrides.kernels" if schema is ThroughputConfig else "kernels"


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda schema: schema.__name__)
def test_model_overrides_kernels_is_the_key_of_every_job_whose_model_is_a_name(schema, tmp_path):
    assert schema().model_overrides == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = load_config(schema, None, [*required(schema, tmp_path), "model_overrides.kernels=liger"])
    assert config.model_overrides == {"kernels": "liger"}


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda schema: schema.__name__)
def test_the_earlier_key_still_works_with_a_warning_naming_the_new_one(schema, tmp_path):
    old = old_key(schema)
    with pytest.warns(FutureWarning, match=rf"'{old}' is deprecated .*use 'model_overrides\.kernels'"):
        config = load_config(schema, None, [*required(schema, tmp_path), f"{old}=quack"])
    assert config.model_overrides == {"kernels": "quack"}
    old_yaml = tmp_path / "old.yaml"
    section, _, leaf = old.rpartition(".")
    old_yaml.write_text(f"{section}:\n  {leaf}: quack\n" if section else f"{leaf}: quack\n")
    with pytest.warns(FutureWarning, match="is deprecated"):
        assert load_config(schema, old_yaml, required(schema, tmp_path)).model_overrides == {"kernels": "quack"}
    old_yaml.write_text(old_yaml.read_text() + "model_overrides:\n  kernels: liger\n")
    with pytest.raises(ConfigError, match=rf"both '{section or old}' \(deprecated\) and 'model_overrides"):
        load_config(schema, old_yaml, required(schema, tmp_path))


@pytest.mark.parametrize("schema", LOADED_MODEL_SCHEMAS, ids=lambda schema: schema.__name__)
@pytest.mark.parametrize("field", ["kernel", "rope_theta", "max_length"])
def test_a_field_a_loaded_model_may_not_change_is_refused_naming_its_key(schema, field, tmp_path):
    """A misspelt field, or one that would change what the trained weights compute."""
    with pytest.raises(ConfigError, match=rf"invalid config key 'model_overrides\.{field}': not a NeoBERTConfig "
                                          r"field a loaded model may change; the fields: kernels"):
        load_config(schema, None, [*required(schema, tmp_path), f"model_overrides.{field}=1"])
