"""Resume, overrides and evaluation inputs (docs/reliability.md, "Resume, overrides and evaluation inputs").
Each used to end in a traceback or a misleading line; each is now one line naming the key, the flag or the file
(or, for a large mixture temperature, simply works)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

# Imported here, at collection: libraries bind their log handlers to the sys.stderr of their first import, which
# inside a test is that test's captured stream (closed after it).
from experiments import contrastive as contrastive_cli
from experiments import heldout as heldout_cli
from experiments import long_context as long_context_cli
from experiments import pretrain as pretrain_cli
from neobert.config import ConfigError, load_config
from neobert.config.pretrain import PretrainConfig
from neobert.errors import DataError
from neobert.jobs.cli import run_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _drop_log_handlers_the_commands_install():
    """A command's `logging.basicConfig` writes to the stream it found (this test's captured one, closed after)."""
    handlers = list(logging.root.handlers)
    yield
    for handler in [h for h in logging.root.handlers if h not in handlers]:
        logging.root.removeHandler(handler)


def error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error: ")]


def version_dirs(run: Path) -> dict[str, list[str]]:
    return {name: sorted(p.name for p in (run / name).iterdir()) for name in ("logs", "tensorboard")
            if (run / name).is_dir()}


# ---------------------------------------------------------------------------------------------- 9. optimizer.name
def test_changing_the_optimizer_on_resume_is_one_line_and_leaves_no_log_directories(tmp_path, capsys):
    """AdamW -> muon (`KeyError: 'muon'`), -> stable_adamw (`KeyError: 'triton'`), muon -> adamw
    (`KeyError: 'param_groups'`): each refused before the Trainer makes this run's log directories."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2")
    run, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert run_cli(pretrain_cli.main, ["--config", str(config)]) == 0
    before = version_dirs(run)
    for name in ("muon", "stable_adamw"):
        capsys.readouterr()
        argv = ["--config", str(config), "resume=true", "trainer.max_steps=4", f"optimizer.name={name}"]
        assert run_cli(pretrain_cli.main, argv) == 2
        assert error_lines(capsys) == [
            f"error: invalid config key 'optimizer.name': {last} was trained with optimizer.name='adamw', this run "
            f"asks for {name!r} (an optimizer cannot continue another one's state): resume it with "
            f"optimizer.name=adamw, or start a new run in another output_dir with init_from={last} (its weights, "
            f"a new {name} optimizer)"]
        assert version_dirs(run) == before  # no empty logs/version_N

    (tmp_path / "muon").mkdir()
    muon = write_yaml(tmp_path / "muon", "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2",
                      "optimizer.name=muon")
    run, last = tmp_path / "muon" / "run", tmp_path / "muon" / "run" / "checkpoints" / "last.ckpt"
    assert run_cli(pretrain_cli.main, ["--config", str(muon)]) == 0
    before = version_dirs(run)
    capsys.readouterr()
    argv = ["--config", str(muon), "resume=true", "trainer.max_steps=4", "optimizer.name=adamw"]
    assert run_cli(pretrain_cli.main, argv) == 2
    assert error_lines(capsys) == [
        f"error: invalid config key 'optimizer.name': {last} was trained with optimizer.name='muon', this run asks "
        f"for 'adamw' (an optimizer cannot continue another one's state): resume it with optimizer.name=muon, or "
        f"start a new run in another output_dir with init_from={last} (its weights, a new adamw optimizer)"]
    assert version_dirs(run) == before
    # the same optimizer resumes as before
    assert run_cli(pretrain_cli.main, ["--config", str(muon), "resume=true", "trainer.max_steps=3"]) == 0


def test_changing_the_optimizer_of_a_contrastive_run_on_resume_is_one_line(tmp_path, capsys):

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"question {i % 7}", "positive": f"answer {i}"}) + "\n"
                            for i in range(24)))
    output = tmp_path / "out"
    argv = ["--config", "contrastive", "--model", "preset:tiny", "--output-dir", str(output),
            "data.datasets=[Pairs]", f"data.local_files.Pairs={data}", "data.batch_size=4", "data.max_length=16",
            "trainer.checkpoint_every_n_steps=2", "trainer.precision=32-true", "trainer.accelerator=cpu",
            "logging.progress_bar=false"]
    assert run_cli(contrastive_cli.main, argv + ["trainer.max_steps=2"]) == 0
    before = version_dirs(output)
    capsys.readouterr()
    assert run_cli(contrastive_cli.main, argv + ["trainer.max_steps=4", "resume=true", "optimizer.name=muon"]) == 2
    last = output / "checkpoints" / "last.ckpt"
    assert error_lines(capsys) == [
        f"error: invalid config key 'optimizer.name': {last} was trained with optimizer.name='adamw', this run asks "
        f"for 'muon' (an optimizer cannot continue another one's state): resume it with optimizer.name=adamw, or "
        f"choose another output_dir to start over"]
    assert version_dirs(output) == before


# ---------------------------------------------------------------------------------------------- 10. list items
@pytest.fixture
def two_sources(tmp_path) -> Path:
    """tp.yaml's shape: two local sources and three phases."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"content": f"text of {name}"}) + "\n")
    path = tmp_path / "tp.yaml"
    path.write_text(f"""\
data:
  source: null
  sources:
    - {{name: a, source: {tmp_path / 'a.jsonl'}, text_column: content, weight: 0.5}}
    - {{name: b, source: {tmp_path / 'b.jsonl'}, text_column: content, weight: 0.5}}
trainer:
  max_steps: 6
phases:
  - {{name: one, steps: 2}}
  - {{name: two, steps: 2, overrides: {{masking.rate: 0.2}}}}
  - {{name: three}}
""")
    return path


def test_a_list_item_is_overridden_by_its_index(two_sources):
    config = load_config(PretrainConfig, two_sources, ["data.sources.0.weight=0"])
    assert [(s.name, s.weight) for s in config.data.sources] == [("a", 0.0), ("b", 0.5)]
    assert config.data.sources[0].source.endswith("a.jsonl")  # the item's other keys are kept
    config = load_config(PretrainConfig, two_sources, ["phases.0.steps=3", "phases[2].name=last"])
    assert [(p.name, p.steps) for p in config.phases][:2] == [("one", 3), ("two", 2)]
    assert config.phases[2].name == "last"
    # a phase's overrides take dotted keys, as in the YAML
    config = load_config(PretrainConfig, two_sources, ["phases.1.overrides.data.max_length=64"])
    assert config.phases[1].overrides == {"masking.rate": 0.2, "data.max_length": 64}
    config = load_config(PretrainConfig, "recipes/cpu-phases", ["phases.0.steps=2"])
    assert [p.steps for p in config.phases] == [2, 60, 60]
    # a whole item, an item of a list of numbers, and an override after one that replaced the list
    config = load_config(PretrainConfig, two_sources, ["data.sources.1={name: c, source: x.jsonl, weight: 2}",
                                                       "optimizer.betas=[0.8,0.9]", "optimizer.betas.1=0.98"])
    assert (config.data.sources[1].name, config.data.sources[1].weight) == ("c", 2.0)
    assert config.optimizer.betas == [0.8, 0.98]


def test_a_bad_list_index_is_a_config_error_naming_the_key(two_sources):
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, two_sources, ["data.sources.2.weight=0"])
    assert str(err.value) == ("command-line overrides: invalid config key 'data.sources.2.weight': data.sources "
                              "has 2 items (indices 0 to 1)")
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, two_sources, ["data.sources.a.weight=0"])
    assert str(err.value) == ("command-line overrides: invalid config key 'data.sources.a.weight': data.sources "
                              "is a list: give an item's index (0 to 1), e.g. 'data.sources.0.weight'")
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, None, ["data.sources.0.weight=0"])
    assert str(err.value) == ("command-line overrides: invalid config key 'data.sources.0.weight': data.sources "
                              "is empty: set the whole list (data.sources=[...])")
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, two_sources, ["data.sources.0.wieght=0"])
    assert str(err.value) == ("command-line overrides: unknown config key 'data.sources.0.wieght'; did you mean "
                              "'data.sources.0.weight'?")
    with pytest.raises(ConfigError, match=r"^command-line overrides: invalid config key 'data.sources.0.weight': "
                                          r"Value 'heavy' .* could not be converted to Float"):
        load_config(PretrainConfig, two_sources, ["data.sources.0.weight=heavy"])


def test_a_list_item_override_on_the_command_line(two_sources, capsys):

    assert run_cli(pretrain_cli.main, ["--config", str(two_sources), "data.sources.5.weight=0", "--preflight"]) == 2
    assert error_lines(capsys) == ["error: command-line overrides: invalid config key 'data.sources.5.weight': "
                                   "data.sources has 2 items (indices 0 to 1)"]


# ---------------------------------------------------------------------------------------------- 11. bad values
def test_long_context_lengths_too_short_for_the_hidden_sentence_are_refused(tmp_path, capsys):

    argv = ["--model", "preset:tiny", "lengths=[8,256]", "tasks=[passkey]", "--output-dir", str(tmp_path / "out")]
    assert run_cli(long_context_cli.main, argv) == 2
    [line] = error_lines(capsys)
    assert line.startswith("error: invalid config key 'lengths': [8] cannot hold the passkey task's hidden sentence "
                           "(up to "), line
    assert line.endswith(" tokens of preset:tiny's tokenizer): choose longer lengths (LongEmbed's start at 256)")
    assert not (tmp_path / "out").exists()


def test_long_context_examples_per_length_above_the_distinct_sentences_is_refused_at_load():
    from neobert.config.long_context import MAX_EXAMPLES_PER_LENGTH, LongContextConfig
    from neobert.data import long_context

    with pytest.raises(ConfigError) as err:
        load_config(LongContextConfig, None, ["models=[preset:tiny]", "examples_per_length=101", "tasks=[needle]"])
    assert str(err.value) == ("invalid config key 'examples_per_length': the needle task has 100 distinct hidden "
                              "sentences, so at most 100 documents per length; got 101")
    with pytest.raises(ConfigError, match="the passkey task has 500 distinct"):
        load_config(LongContextConfig, None, ["models=[preset:tiny]", "examples_per_length=501", "tasks=[passkey]"])
    with pytest.raises(ConfigError, match="the needle task has 100 distinct"):  # both tasks: the tighter limit
        load_config(LongContextConfig, None, ["models=[preset:tiny]", "examples_per_length=101"])
    assert load_config(LongContextConfig, None, ["models=[x]", "examples_per_length=101",
                                                 "tasks=[passkey]"]).examples_per_length == 101
    # the limits are the generator's
    assert MAX_EXAMPLES_PER_LENGTH == {
        "passkey": len(long_context.FIRST_NAMES) * len(long_context.LAST_NAMES),
        "needle": len(long_context.CITIES) * len(long_context.NEEDLE_TEMPLATES)}


@pytest.mark.parametrize("flag, value, message", [
    ("--documents", "0", "argument --documents: must be a positive integer, got '0'"),
    ("--documents", "-3", "argument --documents: must be a positive integer, got '-3'"),
    ("--mask-rate", "0", "argument --mask-rate: must be a number in (0, 1), got '0'"),
    ("--mask-rate", "1", "argument --mask-rate: must be a number in (0, 1), got '1'"),
    ("--max-length", "4", "argument --max-length: must be an integer of at least 8, got '4'"),
])
def test_heldout_flags_out_of_range_are_usage_errors(tmp_path, capsys, flag, value, message):

    with pytest.raises(SystemExit) as exit_:
        heldout_cli.main([f"a={tmp_path}", "--source", f"d={tmp_path / 'd.jsonl'}", "--output-dir",
                          str(tmp_path / "out"), flag, value])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # `heldout.py: error: ...` (the program: argv[0])
    assert last.split(": ", 1)[1] == f"error: {message}"


def test_a_large_mixture_temperature_is_computed_in_log_space(tmp_path):
    from neobert.data.mixture import mixture_sources

    paths = []
    for name, docs in (("a", 100), ("b", 60), ("c", 5)):
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps({"content": f"{name} document {i}"}) + "\n" for i in range(docs)))
    sources = ", ".join(f"{{name: {p.stem}, source: {p}, weight: {w}}}" for p, w in zip(paths, (1, 2, 1)))
    data = load_config(PretrainConfig, None, [f"data.sources=[{sources}]", "data.mixture_temperature=100"]).data
    sizes = [p.stat().st_size for p in paths]  # 2,000+ bytes: size^100 is past a float (it was an OverflowError)
    exact = [w * s**100 for w, s in zip((1, 2, 1), sizes)]  # Python integers: exact
    assert [s.probability for s in mixture_sources(data)] == pytest.approx([e / sum(exact) for e in exact],
                                                                          rel=1e-12)
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, None, ["data.mixture_temperature=.inf"])
    assert str(err.value) == ("invalid config key 'data.mixture_temperature': must be a finite number >= 0 "
                              "(0 = the weights alone), got inf")


# ---------------------------------------------------------------------------------------------- 12. messages
def test_a_beir_path_that_is_a_file_says_so(tmp_path):
    from neobert.eval.mteb import resolve_tasks

    path = tmp_path / "corpus.jsonl"
    path.write_text("{}\n")
    with pytest.raises(DataError) as err:
        resolve_tasks([f"beir:{path}"])
    assert str(err.value) == (f"BEIR directory {str(path)!r} is a file, not a directory (a BEIR directory holds "
                              f"corpus.jsonl, queries.jsonl and qrels/<split>.tsv)")


def test_a_beir_split_given_as_a_path_is_not_called_missing(tmp_path):
    from test_mteb_beir import write_beir

    from neobert.eval.mteb import resolve_tasks

    directory = write_beir(tmp_path / "a" / "b" / "beir")
    write_beir(tmp_path / "good")
    for split in ("../../good/qrels/test", "test.tsv"):
        with pytest.raises(DataError) as err:
            resolve_tasks([f"beir:{directory}"], beir_split=split)
        assert str(err.value) == (f"`beir_split`={split!r} is not a split name: a split is the name of a qrels "
                                  f"file of {directory / 'qrels'} without .tsv (splits there: ['test'])")


@pytest.mark.parametrize("theta", ["-1", "0"])
def test_a_rope_base_that_is_not_positive_is_refused_naming_the_key(tmp_path, capsys, theta):
    from neobert.model import NeoBERTConfig
    from test_pretrain_slow import write_yaml

    with pytest.raises(ValueError, match=r"^NeoBERTConfig.rope_theta must be a positive number \(the RoPE base"):
        NeoBERTConfig.from_preset("tiny", rope_theta=float(theta))
    config = write_yaml(tmp_path, "trainer.max_steps=2")
    assert run_cli(pretrain_cli.main, ["--config", str(config), f"model.overrides.rope_theta={theta}"]) == 2
    assert error_lines(capsys) == [f"error: invalid config key 'model.overrides.rope_theta': must be a positive "
                                   f"number (the RoPE base, e.g. 10000.0), got {int(theta)}"]
    assert not (tmp_path / "run").exists()
