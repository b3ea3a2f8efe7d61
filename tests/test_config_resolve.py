"""A config is resolved once and validated once: the loader calls the schema's `resolve()` (what other keys
decide, written into the config) and then its `validate()`, which only checks; a run does not validate again what
the loader validated."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pkgutil

import pytest
from test_configs_packaged import schema_for
from test_pretrain import tiny_config

import neobert.config
from neobert.config import ConfigError, load_config, packaged_config_names
from neobert.config.pretrain import PretrainConfig
from neobert.instruments.preflight import preflight_report
from neobert.jobs.phases import phase_config
from neobert.jobs.pretrain import prepare


def schemas() -> list[type]:
    """Every dataclass of neobert/config with a validate() that needs no argument."""
    found = {}
    for module in pkgutil.iter_modules(neobert.config.__path__):
        for value in vars(importlib.import_module(f"neobert.config.{module.name}")).values():
            if dataclasses.is_dataclass(value) and isinstance(value, type) and hasattr(value, "validate"):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[name] for name in sorted(found)]


def validated(config):
    """`config` after validate(), whether it passed or not."""
    try:
        config.validate()
    except ConfigError:
        pass
    return config


@pytest.mark.parametrize("schema", schemas(), ids=lambda schema: schema.__name__)
def test_validate_changes_nothing_in_any_schema(schema):
    config = schema()
    before = copy.deepcopy(config)
    assert validated(config) == before


@pytest.mark.parametrize("name", packaged_config_names())
def test_validate_changes_nothing_in_any_shipped_config_and_resolve_is_done_once(name):
    config = load_config(schema_for(name), name)
    before = copy.deepcopy(config)
    assert validated(config) == before
    if hasattr(config, "resolve"):
        config.resolve()
        assert config == before  # the loader resolved it: nothing is left to derive


def test_what_resolve_derives_validate_leaves_as_given():
    config = PretrainConfig()
    config.model.compile = True
    config.data.packing, config.data.static_shapes = "True", "auto"  # as YAML's true and the default reach a str
    with pytest.raises(ConfigError, match="data.packing"):  # the legacy boolean is resolve's to translate
        config.validate()
    assert (config.data.packing, config.data.static_shapes) == ("True", "auto")
    with pytest.warns(FutureWarning, match="data.packing=True is deprecated .*use data.packing=greedy"):
        config.resolve()
    assert (config.data.packing, config.data.static_shapes) == ("greedy", "true")
    config.validate()


def test_the_loader_resolves_then_validates_once_and_the_run_does_not_validate_again(tmp_path, monkeypatch):
    calls = []
    for step in ("resolve", "validate"):
        original = getattr(PretrainConfig, step)

        def recorded(self, original=original, step=step):
            calls.append((step, id(self)))
            return original(self)

        monkeypatch.setattr(PretrainConfig, step, recorded)
    config = tiny_config(tmp_path, "data.packing=best_fit")
    assert calls == [("resolve", id(config)), ("validate", id(config))]
    prepare(config)
    preflight_report(config)
    assert calls == [("resolve", id(config)), ("validate", id(config))]


def test_the_attention_backend_the_data_decides_is_derived_per_phase_and_never_recorded():
    phases = "phases=[{name: a, steps: 2}, {name: b, overrides: {data.packing: greedy}}]"
    config = load_config(PretrainConfig, None, ["data.unpad=false", "trainer.max_steps=4", phases])
    phases = [phase_config(config, i) for i in range(2)]
    assert [phase.derived_model_overrides() for phase in phases] == [{}, {"attention_backend": "varlen"}]
    assert all("attention_backend" not in phase.model.overrides for phase in phases)  # checkpoints record the given
    given = load_config(PretrainConfig, None, ["model.overrides.attention_backend=sdpa"])
    assert given.derived_model_overrides() == {}  # model.overrides wins
