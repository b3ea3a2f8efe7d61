"""Bad inputs and what a user sees (docs/reliability.md is the table): every `python -m experiments.<job>` prints a
user error as one line, `error: <message>`, and exits with status 2; `--debug` or NEOBERT_DEBUG=1 shows the
traceback; a real bug keeps its traceback. An empty corpus, a missing model path, a misspelt key, a bad GLUE file,
a read-only or full disk: each named in one line, and none creates a file outside the run directory."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from glue_files import write_parquet_task, write_tsv_task

from experiments import contrastive as contrastive_cli
from experiments import convert_official as convert_cli
from experiments import glue as glue_cli
from experiments import mteb as mteb_cli
from experiments import pretrain as pretrain_cli
from neobert import outputs
from neobert.config import ConfigError, load_config
from neobert.config.pretrain import MaskingConfig, PretrainConfig, PretrainDataConfig
from neobert.data import corpus
from neobert.data.backbone import load_backbone
from neobert.data.corpus import local_data_files, pretokenize
from neobert.data.glue import get_task, load_glue_split
from neobert.data.pretraining import PretrainingDataModule, PretrainingStream
from neobert.data.tokenizer import load_tokenizer
from neobert.errors import DataError
from neobert.hub import HubUnreachableError, is_hub_name
from neobert.jobs.cli import run_cli
from neobert.jobs.pretrain import init_weights, prepare
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def exact(message: str) -> str:
    """A `match=` pattern for exactly this message."""
    return "^" + re.escape(message) + "$"


def starts(message: str) -> str:
    return "^" + re.escape(message)


def files_under(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def error_line(stderr: str) -> str:
    """The one `error:` line of a failed command (log lines, if any, come before it); no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr_lines(stderr) if line.startswith("error: ")]
    assert len(errors) == 1 and stderr_lines(stderr)[-1] == errors[0], stderr
    return errors[0]


def blank_corpus(directory: Path) -> Path:
    """Two empty documents and one of undecodable text (U+FFFD, what bad bytes become): nothing to train on."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "blank.jsonl"
    path.write_text("".join(json.dumps({"content": text}) + "\n" for text in ("", "   ", "broken \ufffd bytes")))
    return path


def real_corpus(directory: Path, n: int = 40) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "docs.jsonl"
    path.write_text("".join(json.dumps({"content": f"Document {i} is about parsers and lexers, part {i}."}) + "\n"
                            for i in range(n)))
    return path


# ---------------------------------------------------------------------------------------------- command lines
def test_command_lines_print_one_line_exit_2_and_debug_shows_the_traceback(tmp_path):
    """The real `python -m experiments.pretrain`, three at once (each spends ~10 s importing): a misspelt key and
    an empty corpus are one line and status 2; --debug shows the traceback. Nothing is written in the cwd."""
    cwd, data = tmp_path / "cwd", tmp_path / "data"
    cwd.mkdir()
    corpus_file = blank_corpus(data)
    before = {p: p.read_bytes() for p in data.iterdir()}
    env = {k: v for k, v in os.environ.items() if k != "NEOBERT_DEBUG"}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    commands = {
        "typo": ["trainer.max_stepz=3"],
        "empty": [f"data.source={corpus_file}"],
        "debug": ["trainer.max_stepz=3", "--debug"],
    }
    running = {name: subprocess.Popen([sys.executable, "-m", "experiments.pretrain", *argv], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, argv in commands.items()}
    done = {name: (process.wait(timeout=600), process.communicate()[1]) for name, process in running.items()}

    status, stderr = done["typo"]
    assert status == 2, stderr
    assert error_line(stderr) == ("error: command-line overrides: unknown config key 'trainer.max_stepz'; "
                                  "did you mean 'trainer.max_steps'?")
    status, stderr = done["empty"]
    assert status == 2, stderr
    assert error_line(stderr) == (f"error: data.source={str(corpus_file)!r} has no usable documents "
                                  f"(2 empty, 1 undecodable)")
    status, stderr = done["debug"]
    assert status == 1 and "Traceback (most recent call last)" in stderr, stderr
    assert stderr_lines(stderr)[-1].startswith("neobert.errors.ConfigError: command-line overrides: unknown config "
                                               "key 'trainer.max_stepz'")
    assert files_under(cwd) == []  # no runs/demo, no corpus written
    assert {p: p.read_bytes() for p in data.iterdir()} == before


def test_config_mistakes_are_one_line_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NEOBERT_DEBUG", raising=False)
    cases = {
        ("trainer.max_stepz=3",): "unknown config key 'trainer.max_stepz'; did you mean 'trainer.max_steps'?",
        ("resum=true",): "unknown config key 'resum'; did you mean 'resume'?",
        ("max_steps=3",): "unknown config key 'max_steps'; did you mean 'trainer.max_steps'?",
        ("data.sorce=x",): "unknown config key 'data.sorce'; did you mean 'data.source'?",
        ("trainer.max_steps=many",): ("invalid config key 'trainer.max_steps': Value 'many' of type 'str' could not "
                                      "be converted to Integer"),
        ("--config", "nowhere.yaml"): "config file 'nowhere.yaml' does not exist (neither a path nor a packaged",
        # a scalar for a whole section (merge errors carry no key: it was "invalid config key None: None")
        ("model=foo",): ("invalid config key 'model': is a section (ModelConfig), not a value: got the str 'foo'; "
                         "set its keys instead (model.<key>=...)"),
        ("--config", "glue/rte"): "rte.yaml: invalid config key 'model': is a section (ModelConfig), not a value",
        # pretraining needs a step count: -1 is not offered and then refused
        ("trainer.max_steps=-3",): "invalid config key 'trainer.max_steps': must be positive, got -3",
        ("trainer.max_steps=-1",): "invalid config key 'trainer.max_steps': must be positive, got -1",
    }
    for argv, message in cases.items():
        assert run_cli(pretrain_cli.main, list(argv)) == 2
        out = capsys.readouterr()
        assert stderr_lines(out.err) == [error_line(out.err)] and message in out.err, (argv, out.err)
    with pytest.raises(ConfigError, match="did you mean 'trainer.max_steps'"):
        run_cli(pretrain_cli.main, ["trainer.max_stepz=3", "--debug"])
    monkeypatch.setenv("NEOBERT_DEBUG", "1")
    with pytest.raises(ConfigError, match="did you mean 'trainer.max_steps'"):
        run_cli(pretrain_cli.main, ["trainer.max_stepz=3"])
    assert files_under(tmp_path) == []


def test_a_real_bug_keeps_its_traceback(monkeypatch, capsys):
    def broken(*args, **kwargs):
        return 1 / 0

    monkeypatch.delenv("NEOBERT_DEBUG", raising=False)
    monkeypatch.setattr(pretrain_cli, "load_pretrain_config", broken)
    with pytest.raises(ZeroDivisionError):
        run_cli(pretrain_cli.main, ["trainer.max_steps=3"])
    with pytest.raises(ValueError, match="not a user error"):  # a plain ValueError is a bug, not an input error
        run_cli(lambda argv: (_ for _ in ()).throw(ValueError("not a user error")), [])
    assert "error:" not in capsys.readouterr().err


def test_os_and_worker_errors_become_one_line(capsys):
    from torch._utils import ExceptionWrapper

    try:
        raise DataError("data.source='x.jsonl' has no usable documents (3 empty, 0 undecodable)")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")

    def fails_with(err):
        def main(argv):
            raise err
        return main

    cases = [
        (fails_with(OSError(errno.ENOSPC, "No space left on device", "/runs/x/shard.tmp")),
         "error: No space left on device: '/runs/x/shard.tmp'"),
        (fails_with(PermissionError(errno.EACCES, "Permission denied", "/ro/run")),
         "error: Permission denied: '/ro/run'"),
        (fails_with(HubUnreachableError("the hub cannot be reached.\nSet `model` to local files.")),
         "error: the hub cannot be reached. Set `model` to local files."),
        (lambda argv: wrapped.reraise(),  # raised in a DataLoader worker: the original message, not its traceback
         "error: data.source='x.jsonl' has no usable documents (3 empty, 0 undecodable)"),
    ]
    for main, line in cases:
        assert run_cli(main, []) == 2
        assert stderr_lines(capsys.readouterr().err) == [line]


# ---------------------------------------------------------------------------------------------- empty corpus
EMPTY_CORPORA = {
    "empty.jsonl": (b"", "(0 empty, 0 undecodable); its 1 file(s) are empty"),
    "blank.jsonl": (b'{"content": ""}\n{"content": "  "}\n', "(2 empty, 0 undecodable)"),
    "undecodable.txt": (b"broken \xff\xfe bytes\n\nmore \xff\n", "(0 empty, 2 undecodable)"),
    "blank.txt": (b"\n\n   \n\n", "(1 empty, 0 undecodable)"),
}


@pytest.mark.timeout(120)  # a corpus of skipped documents only used to loop forever, epoch after epoch
@pytest.mark.parametrize("name", list(EMPTY_CORPORA))
def test_an_empty_corpus_is_a_data_error_before_the_first_batch(tmp_path, tokenizer, name):
    content, counts = EMPTY_CORPORA[name]
    path = tmp_path / name
    path.write_bytes(content)
    data = PretrainDataConfig(source=str(path), text_column="content", max_length=64, shuffle_buffer=8,
                              num_workers=0)
    message = f"data.source={str(path)!r} has no usable documents {counts}"
    with pytest.raises(DataError) as err:
        PretrainingDataModule(data, MaskingConfig(), tokenizer, 2).check_source()  # before any training work
    assert str(err.value) == message
    with pytest.raises(DataError) as err:  # and the stream itself, at its first batch (a hub corpus ends here)
        next(iter(PretrainingStream(data, MaskingConfig(), tokenizer, 2)))
    assert str(err.value) == message


def test_a_corpus_held_out_entirely_for_validation_says_so(tmp_path, tokenizer):
    path = real_corpus(tmp_path, n=5)
    data = PretrainDataConfig(source=str(path), text_column="content", validation_docs=64, num_workers=0)
    with pytest.raises(DataError, match=r"has 5 usable documents, all among the first data.validation_docs=64"):
        PretrainingDataModule(data, MaskingConfig(), tokenizer, 2).check_source()


@pytest.mark.timeout(120)  # documents shorter than every length bucket used to be dropped forever
def test_length_buckets_above_every_document_are_a_data_error(tmp_path, tokenizer):
    path = real_corpus(tmp_path, n=10)
    data = PretrainDataConfig(source=str(path), text_column="content", max_length=2048, shuffle_buffer=4,
                              num_workers=0, length_buckets=[1024], bucket_probabilities=[1.0])
    with pytest.raises(DataError, match=exact(f"data.source={str(path)!r} has no document of at least "
                                              f"data.length_buckets[0]=1024 tokens (stream 0 of 1): lower "
                                              f"data.length_buckets")):
        next(iter(PretrainingStream(data, MaskingConfig(), tokenizer, 1)))


def test_non_utf8_json_lines_are_a_data_error_naming_the_source_file_and_line(tmp_path, tokenizer):
    """In a directory of files the reader's "position 3" named neither the file nor the line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text(json.dumps({"content": "plain text"}) + "\n")
    path = tmp_path / "docs" / "latin1.jsonl"
    path.write_bytes('{"content": "ok"}\n{"content": "caf\xe9 au lait"}\n'.encode("latin-1"))
    data = PretrainDataConfig(source=str(path.parent), text_column="content", num_workers=0)
    with pytest.raises(DataError) as raised:
        PretrainingDataModule(data, MaskingConfig(), tokenizer, 2).check_source()
    assert str(raised.value) == (f"data.source={str(path.parent)!r} cannot be read: line 2 of {path} is not UTF-8 "
                                 f"(byte b'\\xe9' at column 17: invalid continuation byte)")


def test_a_malformed_json_line_is_one_line_naming_the_file_line(tmp_path):
    from test_pretrain_slow import cli

    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"content": f"document {i}"}) for i in range(50)]
    path.write_text("\n".join(lines[:10] + [""] + lines[10:] + ["{not json"] + lines[:3]) + "\n")
    # the 52nd line (a blank one before it): datasets says "row 50", and logged its own error twice above ours
    proc = cli(f"data.source={path}", "data.validation_docs=0", "data.baseline_docs=0",
               f"output_dir={tmp_path / 'run'}")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert (f"error: data.source='{path}' cannot be read: line 52 of {path} is not JSON (Expecting property name "
            f"enclosed in double quotes, column 2)") in out
    assert [line for line in out.splitlines() if str(path) in line and "INFO" not in line] == [
        line for line in out.splitlines() if line.startswith("error:")], out


def test_pretokenizing_an_empty_corpus_writes_nothing(tmp_path, tokenizer):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(EMPTY_CORPORA["blank.jsonl"][0])
    data = PretrainDataConfig(source=str(path), text_column="content")
    with pytest.raises(DataError, match=r"has no usable documents \(2 empty, 0 undecodable\)"):
        pretokenize(data, tokenizer, tmp_path / "shards")
    assert not (tmp_path / "shards").exists()


# ---------------------------------------------------------------------------------------------- paths and hub names
def test_one_rule_tells_hub_names_from_paths(tmp_path):
    hub = ["tiiuae/falcon-refinedweb", "chandar-lab/NeoBERT", "bert-base-uncased", "wikitext", "owner/model.v2"]
    paths = ["/tmp/missing_dir", "./model", "../model", "~/model", "runs/demo/export", "corpus.jsonl",
             "owner/data.parquet", "weights.safetensors", "data/*.jsonl", "preset:nope", "C:\\models\\x", "my model"]
    assert [n for n in hub if not is_hub_name(n)] == [] and [n for n in paths if is_hub_name(n)] == []
    assert local_data_files("tiiuae/falcon-refinedweb") is None
    for missing in (f"{tmp_path}/typo.jsonl", "runs/demo/corpus", "data/typo.jsonl", "./typo"):
        with pytest.raises(ConfigError, match=exact(f"data.source={missing!r} does not exist")):
            local_data_files(missing)


def test_a_missing_model_path_is_named_never_downloaded(tmp_path):
    missing = str(tmp_path / "missing_dir")
    with pytest.raises(ConfigError, match=exact(f"model={missing!r} does not exist (a local model directory was "
                                                f"expected; hub models are named owner/name)")):
        load_backbone(missing)
    with pytest.raises(ConfigError, match=starts(f"tokenizer={missing!r} does not exist")):
        load_tokenizer(missing)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match=r"is a directory without config.json: not a model directory"):
        load_backbone(str(tmp_path / "empty_dir"))
    with pytest.raises(ConfigError, match=r"^model='preset:nope': unknown model preset 'nope'"):
        load_backbone("preset:nope")
    with pytest.raises(HubUnreachableError, match="`model`"):  # an owner/name is a hub name (HF_HUB_OFFLINE=1)
        load_backbone("someone/some-encoder")


def test_a_missing_model_in_the_mteb_and_contrastive_command_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NEOBERT_DEBUG", raising=False)
    missing = str(tmp_path / "missing_dir")
    sts = tmp_path / "sts.csv"
    sts.write_text("genre\tfile\tyear\tid\t4.0\tA cat sits.\tA cat is sitting.\n")
    argv = {mteb_cli.main: ["--model", missing, "--tasks", f"sts:{sts}", f"output_dir={tmp_path / 'out'}"],
            contrastive_cli.main: ["--config", "contrastive", "--model", missing, f"output_dir={tmp_path / 'out'}"]}
    for main, args in argv.items():
        assert run_cli(main, args) == 2
        assert error_line(capsys.readouterr().err).startswith(f"error: model='{missing}' does not exist")
    assert files_under(tmp_path) == ["sts.csv"]


def test_a_missing_model_in_the_glue_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NEOBERT_DEBUG", raising=False)
    write_parquet_task(tmp_path / "glue", "rte")
    missing = str(tmp_path / "missing_dir")
    assert run_cli(glue_cli.main, ["--task", "rte", "--model", missing, f"data.path={tmp_path / 'glue'}",
                                   f"output_dir={tmp_path / 'out'}"]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: model='{missing}' does not exist")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- GLUE files
def test_a_glue_file_with_a_missing_column_names_the_file_and_the_column(tmp_path):
    frames = write_parquet_task(tmp_path / "p", "rte")
    train = tmp_path / "p" / "rte" / "train.parquet"
    frames["train"].drop(columns=["sentence2"]).to_parquet(train)
    with pytest.raises(DataError, match=starts(f"{train}: GLUE rte/train needs the column(s) ['sentence2'], which are "
                                              f"missing (found [")):
        load_glue_split(get_task("rte"), "train", tmp_path / "p")
    directory = write_tsv_task(tmp_path / "t", "rte", frames)
    lines = (directory / "train.tsv").read_text().splitlines()
    (directory / "train.tsv").write_text("\n".join([lines[0].replace("sentence2", "hypothesis"), *lines[1:]]) + "\n")
    with pytest.raises(DataError, match=starts(f"{directory / 'train.tsv'}: columns ['sentence2'] are missing")):
        load_glue_split(get_task("rte"), "train", tmp_path / "t")


def test_glue_labels_out_of_range_name_the_file(tmp_path):
    frames = write_parquet_task(tmp_path, "rte")
    frames["train"].loc[3, "label"] = 2
    train = tmp_path / "rte" / "train.parquet"
    frames["train"].to_parquet(train)
    with pytest.raises(DataError, match=exact(f"{train}: GLUE rte/train: 1 labels out of range, expected integers in "
                                              f"[0, 2); first (row, label): [(3, 2)]")):
        load_glue_split(get_task("rte"), "train", tmp_path)


def test_unreadable_glue_files_and_paths_are_named(tmp_path):
    write_parquet_task(tmp_path, "rte")
    (tmp_path / "rte" / "validation.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match=r"validation.parquet: not a readable parquet file \(corrupt or truncated\?\)"):
        load_glue_split(get_task("rte"), "validation", tmp_path)
    tsv = tmp_path / "t" / "rte" / "train.tsv"
    tsv.parent.mkdir(parents=True)
    tsv.write_bytes(b"index\tsentence1\tsentence2\tlabel\n0\tcaf\xe9\tok\tentailment\n")
    with pytest.raises(DataError, match=starts(f"{tsv} is not UTF-8 text: 'utf-8' codec can't decode")):
        load_glue_split(get_task("rte"), "train", tmp_path / "t")
    with pytest.raises(FileNotFoundError, match=exact(f"data.path={str(tsv)!r} is not a directory")):
        load_glue_split(get_task("rte"), "train", tsv)


def test_an_unknown_glue_task_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        glue_cli.main(["--task", "nosuch"])
    assert exit_.value.code == 2
    assert "error: argument --task: invalid choice: 'nosuch' (choose from" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^unknown GLUE task 'nosuch'; known tasks: \['cola'"):
        get_task("nosuch")


def test_a_malformed_override_of_convert_official_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        convert_cli.main([str(tmp_path / "state_dict.pt"), str(tmp_path / "out"), "max_length"])
    assert exit_.value.code == 2
    assert "error: overrides must look like field=value, got ['max_length']" in capsys.readouterr().err
    assert files_under(tmp_path) == []


# ---------------------------------------------------------------------------------------------- models, runs, disks
def pretrain_config(tmp_path: Path, *overrides: str) -> PretrainConfig:
    base = ["model.preset=tiny", "model.overrides.max_length=64", f"data.source={real_corpus(tmp_path / 'data')}",
            "data.text_column=content", "data.max_length=32", "data.num_workers=0", "trainer.accelerator=cpu",
            "trainer.devices=1", f"output_dir={tmp_path / 'run'}"]
    return load_config(PretrainConfig, None, base + list(overrides))


def test_a_checkpoint_of_another_model_size_names_the_mis_shaped_tensors(tmp_path):
    NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", vocab_size=1000, max_length=64)).save_pretrained(
        tmp_path / "tiny")
    bigger = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("mini", vocab_size=1000, max_length=64))
    with pytest.raises(ValueError, match=starts(f"{tmp_path / 'tiny'} does not match NeoBERTForMaskedLM: ").rstrip("$")
                       + r".*; mis-shaped tensors: \['decoder.weight: checkpoint \(1000, 64\) vs model \(1000, 256\)', "
                       r"'model.encoder.weight: checkpoint \(1000, 64\) vs model \(1000, 256\)'"):
        init_weights(bigger, tmp_path / "tiny")  # init_from=<export of another size>


def test_an_output_dir_with_checkpoints_needs_resume(tmp_path):
    config = pretrain_config(tmp_path)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000002.ckpt").write_bytes(b"")
    with pytest.raises(ConfigError, match=exact(f"output_dir={str(tmp_path / 'run')!r} already holds checkpoints: "
                                                f"set resume=true to continue that run, or choose another output_dir")):
        prepare(config)


def test_a_read_only_output_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """`--pretokenize` into a directory that cannot be written. chmod 555 stops a normal user; root ignores
    permissions, so mkdir below that directory is also made to fail the way it does for everyone else."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NEOBERT_DEBUG", raising=False)
    source = real_corpus(tmp_path / "data")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if read_only in self.parents:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    try:
        assert run_cli(pretrain_cli.main, ["--pretokenize", str(read_only / "shards"), f"data.source={source}"]) == 2
    finally:
        read_only.chmod(0o755)
    assert error_line(capsys.readouterr().err) == f"error: Permission denied: '{read_only / 'shards'}'"
    assert files_under(tmp_path) == ["data", "data/docs.jsonl", "read_only"]


def test_a_full_disk_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NEOBERT_DEBUG", raising=False)
    source = real_corpus(tmp_path / "data")

    def write_half_then_fail(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 half a shard")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)

    monkeypatch.setattr(corpus.pq, "write_table", write_half_then_fail)
    monkeypatch.setattr(outputs, "free_space", lambda path: 4096)
    assert run_cli(pretrain_cli.main, ["--pretokenize", str(tmp_path / "shards"), f"data.source={source}"]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"error: no space left on device for shard-00000.parquet in {tmp_path / 'shards'}: it needs more than the "
        f"0 kB written before it filled, 4 kB free; no partial shard is left, and the shards this run wrote before "
        f"it are removed (an incomplete set)")
    assert files_under(tmp_path) == ["data", "data/docs.jsonl"]  # no temporary file, shard or empty directory


def test_empty_texts_in_contrastive_and_mteb_files_are_one_line_naming_the_example(tmp_path, capsys, monkeypatch):
    # They used to be a ValueError traceback (status 1), and an STS pair with an empty sentence was scored silently.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NEOBERT_DEBUG", raising=False)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"query": "what is a cat", "positive": "a small animal"}) + "\n"
                     + json.dumps({"query": "", "positive": "a large animal"}) + "\n")
    sts = tmp_path / "sts.csv"
    sts.write_text("genre\tfile\tyear\tid\t4.0\tA cat sits.\tA cat is sitting.\n"
                   "genre\tfile\tyear\tid\t1.0\tA dog runs.\t \n")
    cases = {
        (contrastive_cli.main, ("--config", "contrastive", "--model", "preset:tiny", "data.datasets=[mine]",
                                f"data.local_files.mine={pairs}", f"output_dir={tmp_path / 'c'}")):
            f"error: {pairs}: example 2 has an empty or missing 'query'",
        (mteb_cli.main, ("--model", "preset:tiny", "--tasks", f"retrieval:{pairs}", f"output_dir={tmp_path / 'm'}")):
            f"error: {pairs}: example 2 has an empty or missing 'query'",
        (mteb_cli.main, ("--model", "preset:tiny", "--tasks", f"sts:{sts}", f"output_dir={tmp_path / 's'}")):
            f"error: {sts}:2: an empty sentence2",
    }
    for (main, args), message in cases.items():
        assert run_cli(main, list(args)) == 2, args
        assert error_line(capsys.readouterr().err) == message


def test_a_decoder_given_as_an_encoder_is_warned_about(tmp_path, caplog):
    from transformers import AutoTokenizer, BertConfig, GPT2Config, GPT2LMHeadModel

    from neobert.data.backbone import is_decoder
    from neobert.data.tokenizer import packaged_bert_vocab_dir

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64)).save_pretrained(gpt2)
    AutoTokenizer.from_pretrained(str(packaged_bert_vocab_dir())).save_pretrained(gpt2)
    with caplog.at_level(logging.WARNING, logger="neobert.data.backbone"):
        backbone = load_backbone(str(gpt2))
    assert backbone.hidden_size == 32  # still loaded: it used to be scored (STS -24) without a word
    assert (f"model={str(gpt2)!r} is a decoder-only (causal) model (GPT2LMHeadModel): it is used as an encoder "
            f"here") in caplog.text
    assert not is_decoder(BertConfig(architectures=["BertForMaskedLM"]))
    assert not is_decoder(BertConfig(architectures=["BertLMHeadModel"]))  # an encoder unless is_decoder is set
    assert is_decoder(BertConfig(architectures=["BertLMHeadModel"], is_decoder=True))


@pytest.mark.timeout(120)  # a mixture's epochs are its sources': the stream's own position never moves
@pytest.mark.parametrize("a_max_epochs", [0, 1])  # 1: source a retires, its epoch stops moving
def test_length_buckets_above_every_document_of_a_mixture_are_a_data_error(tmp_path, tokenizer, a_max_epochs):
    from neobert.config.pretrain import DataSourceConfig

    sources = [DataSourceConfig(name=name, source=str(real_corpus(tmp_path / name, n=6)), text_column="content",
                                max_epochs=a_max_epochs if name == "a" else 0) for name in ("a", "b")]
    data = PretrainDataConfig(sources=sources, max_length=2048, shuffle_buffer=4, num_workers=0,
                              length_buckets=[1024], bucket_probabilities=[1.0])
    with pytest.raises(DataError, match=exact("data.sources has no document of at least data.length_buckets[0]=1024 "
                                              "tokens (stream 0 of 1): lower data.length_buckets")):
        next(iter(PretrainingStream(data, MaskingConfig(), tokenizer, 1)))
