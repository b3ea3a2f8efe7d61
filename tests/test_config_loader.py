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


def test_cli_flags_become_typed_overrides_and_a_flag_beside_its_own_key_is_refused():
    from experiments import contrastive, gpu_check, mteb, throughput

    config = throughput.parse_args(["--models", "neobert,bert-base", "--lengths", "128, 512", "--mode", "training",
                                    "--output-dir", "/tmp/tp"])
    assert config.models == ["neobert", "bert-base"] and config.lengths == [128, 512]
    assert config.mode == "training" and config.output_dir == "/tmp/tp"
    # `--steps 4 steps=0` used to take the flag without a word
    with pytest.raises(ConfigError) as err:
        gpu_check.parse_args(["--steps", "4", "steps=0"])
    assert str(err.value) == "--steps 4 and steps=0 both set 'steps': give one of them"
    with pytest.raises(ConfigError, match="--lengths 128 and lengths=.512. both set 'lengths'"):
        throughput.parse_args(["--lengths", "128", "lengths=[512]"])
    config = mteb.parse_args(["--model", "preset:tiny", "--tasks", "sts:/data/a b.csv,STSBenchmark"])
    assert config.model == "preset:tiny" and config.tasks == ["sts:/data/a b.csv", "STSBenchmark"]
    config = contrastive.parse_args(["--model", "runs/x/export", "trainer.max_steps=7"])
    assert config.model == "runs/x/export" and config.trainer.max_steps == 7
    with pytest.raises(ConfigError, match="lengths"):
        throughput.parse_args(["--lengths", "128,long"])
