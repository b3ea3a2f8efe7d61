from dataclasses import dataclass, field

import pytest

from neobert.config import ConfigError, load_config


@dataclass
class Inner:
    lr: float = 1e-3
    steps: int = 10


@dataclass
class Schema:
    name: str = "run"
    inner: Inner = field(default_factory=Inner)


def test_yaml_inherit_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("name: base\ninner:\n  lr: 0.5\n")
    (tmp_path / "child.yaml").write_text("inherit: base.yaml\ninner:\n  steps: 3\n")
    config = load_config(Schema, tmp_path / "child.yaml", ["inner.lr=0.25"])
    assert config == Schema(name="base", inner=Inner(lr=0.25, steps=3))


@pytest.mark.parametrize("yaml,overrides,message", [
    ("inner:\n  stepz: 3\n", [], "stepz"),
    ("inner:\n  steps: many\n", [], "inner.steps"),
    ("", ["inner.lr=fast"], "inner.lr"),
    ("", ["nme=x"], "nme"),
    ("", ["inner.lr"], "key=value"),
])
def test_misspelt_or_ill_typed_keys_are_named(tmp_path, yaml, overrides, message):
    (tmp_path / "c.yaml").write_text(yaml or "{}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(Schema, tmp_path / "c.yaml", overrides)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_config(Schema, tmp_path / "nowhere.yaml")
