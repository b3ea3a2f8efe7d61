"""What a command may write and replace (docs/reliability.md, "Output directories"): nothing a command is not asked
to write is touched, and `--overwrite` / `overwrite=true` replaces only what the suite itself wrote there. One home
decides it before anything is written (`neobert.outputs.claim_output_dir`), for every job: the export, the
fine-tuning task directories (GLUE, NER), the tokenizer trainer, the pretraining job's own export, `--pretokenize`
and the GPU check."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glue_files import write_parquet_task

from experiments import export as export_cli
from experiments import glue as glue_cli
from experiments import ner as ner_cli
from experiments import train_tokenizer as tokenizer_cli
from neobert.config import ConfigError
from neobert.data.corpus import pretokenize
from neobert.data.tokenizer import load_tokenizer
from neobert.jobs.cli import run_cli
from neobert.jobs.phases import PHASE_DONE
from neobert.jobs.pretrain import run_pretokenize, run_pretraining
from neobert.layout import AVERAGING_JSON
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM
from tests.test_ner import synthetic_sentences, write_conll
from tests.test_pretrain import tiny_config

REPO = Path(__file__).resolve().parents[1]


def tree(directory: Path) -> dict[str, bytes | None]:
    """Every file and folder under `directory` with its bytes (None for a folder): to show nothing changed."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(directory.rglob("*"))}


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny pretraining run with a checkpoint at each of its 4 steps."""
    tmp = tmp_path_factory.mktemp("outputs")
    config = tiny_config(tmp, "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=1",
                         "trainer.keep_checkpoints=-1")
    run_pretraining(config)
    return Path(config.output_dir)


# ---------------------------------------------------------------------------------------------- 1. the export
def test_an_export_never_replaces_its_inputs_or_a_run(run, tmp_path, capsys):
    last = run / "checkpoints" / "last.ckpt"
    before = tree(run)
    # into the folder of the checkpoint it reads: it used to delete every checkpoint, the one it read included
    assert run_cli(export_cli.main, [str(last), str(run / "checkpoints"), "--overwrite"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: export directory {run / 'checkpoints'} holds this command's input {last}: an output never goes "
        f"where its inputs are, --overwrite included; choose another export directory")
    # the average of a run into the run itself: it used to replace the whole run directory
    assert run_cli(export_cli.main, [str(run), str(run), "--average", "last:2", "--overwrite"]) == 2
    step_3 = run / "checkpoints" / "step-00000003.ckpt"
    assert one_error_line(capsys.readouterr().err) == (
        f"error: export directory {run} holds this command's input {step_3}: an output never goes where its inputs "
        f"are, --overwrite included; choose another export directory")
    assert tree(run) == before
    # another run's directory (its checkpoints are not this export's inputs): refused all the same
    other = tmp_path / "other_run"
    (other / "checkpoints").mkdir(parents=True)
    shutil.copy(last, other / "checkpoints" / "last.ckpt")
    assert run_cli(export_cli.main, [str(last), str(other), "--overwrite"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: export directory {other} holds checkpoints (checkpoints): an output never replaces a run's "
        f"checkpoints, --overwrite included; choose another export directory")
    assert (other / "checkpoints" / "last.ckpt").read_bytes() == last.read_bytes()


def test_an_export_replaces_only_an_export_and_never_a_neighbour(run, tmp_path, capsys):
    last = run / "checkpoints" / "last.ckpt"
    target = tmp_path / "export"
    # a user's folders named like the old staging and set-aside folders (<target>.tmp, <target>.old) are not touched
    for name in ("export.tmp", "export.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "thesis.txt").write_text("precious")
    export_cli.main([str(last), str(target)])
    export_cli.main([str(last), str(target), "--overwrite"])
    for name in ("export.tmp", "export.old"):
        assert (tmp_path / name / "thesis.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "export.old", "export.tmp"]  # no staging left
    # an export with a file the suite did not write: --overwrite refuses, the file stays
    (target / "notes.txt").write_text("mine")
    before = tree(target)
    assert run_cli(export_cli.main, [str(last), str(target), "--overwrite"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: export directory {target} holds files that are not part of an export (notes.txt): it is written "
        f"only as a whole, never beside other files, --overwrite included; move them out or choose another export "
        f"directory")
    assert tree(target) == before


# ---------------------------------------------------------------------------------------------- 2. fine-tuning
@pytest.fixture
def ner_data(tmp_path) -> Path:
    """A data directory as a user keeps it: the CoNLL files and a README."""
    data = tmp_path / "nerdata" / "wnut17"
    write_conll(data / "train.conll", synthetic_sentences(24, seed=0))
    write_conll(data / "dev.conll", synthetic_sentences(8, seed=1))
    (data / "README").write_text("where these files come from")
    return data


NER_ARGS = ["--task", "wnut17", "--model", "preset:tiny", "trainer.max_steps=2", "trainer.eval_every_n_steps=2",
            "data.batch_size=8", "logging.progress_bar=false"]


def test_a_fine_tuning_run_never_writes_into_its_data(ner_data, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ner_data.parent)
    before = tree(ner_data)
    # `cd nerdata; ... data.path=wnut17 output_dir=.`: the task directory is the data directory. It used to write
    # its results there, and overwrite=true then deleted train.conll, dev.conll and the README
    for extra in ([], ["overwrite=true"]):
        assert run_cli(ner_cli.main, [*NER_ARGS, "data.path=wnut17", "output_dir=.", *extra]) == 2
        assert one_error_line(capsys.readouterr().err) == (
            "error: invalid config key 'output_dir': the task directory wnut17 holds this command's input "
            "data.path='wnut17': an output never goes where its inputs are, overwrite=true included; choose another "
            "output_dir")
        assert tree(ner_data) == before


def test_a_glue_run_never_writes_into_its_task_data(tmp_path, capsys):
    data = tmp_path / "glue"
    write_parquet_task(data, "rte")
    before = tree(data)
    # output_dir = data.path: the task directory glue/rte is the folder of the rte files
    assert run_cli(glue_cli.main, ["--task", "rte", "--model", "preset:tiny", f"data.path={data}",
                                   f"output_dir={data}", "trainer.max_steps=2", "trainer.eval_every_n_steps=2",
                                   "data.batch_size=8", "logging.progress_bar=false", "transfer_from=null"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: invalid config key 'output_dir': the task directory {data / 'rte'} holds this command's input "
        f"{data / 'rte'} (the rte files of data.path='{data}'): an output never goes where its inputs are, "
        f"overwrite=true included; choose another output_dir")
    assert tree(data) == before


def test_overwrite_replaces_only_what_the_fine_tuning_run_wrote(ner_data, tmp_path, capsys):
    out = tmp_path / "out"
    args = [*NER_ARGS, f"data.path={ner_data}", f"output_dir={out}"]
    ner_cli.main(args)
    task_dir = out / "wnut17"
    (task_dir / "notes.md").write_text("my notes on this task")  # the user's, beside the results
    (task_dir / "sweep.md").write_text("an earlier sweep's table")  # the suite's: a stale one
    runs = [p.name for p in task_dir.iterdir() if p.name.startswith("bs")]
    ner_cli.main(args + ["overwrite=true"])
    assert (task_dir / "notes.md").read_text() == "my notes on this task"  # it used to delete the whole directory
    assert not (task_dir / "sweep.md").exists() and (task_dir / "results.json").is_file()
    assert [p.name for p in task_dir.iterdir() if p.name.startswith("bs")] == runs
    # the model it starts from inside the task directory: overwrite would delete it
    assert run_cli(ner_cli.main, [*args, "overwrite=true", "--model", str(task_dir / "best")]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: invalid config key 'output_dir': the task directory {task_dir} holds this command's input "
        f"model='{task_dir / 'best'}': an output never goes where its inputs are, overwrite=true included; choose "
        f"another output_dir")
    assert (task_dir / "best" / "config.json").is_file()


# ---------------------------------------------------------------------------------------------- 3. the tokenizer
@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.jsonl"
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbled boxes".split()
    path.write_text("".join(json.dumps({"text": " ".join(words[i % 7:] + words[:i % 7]) + f" {i}"}) + "\n"
                            for i in range(200)))
    return path


def train(corpus: Path, *args: str) -> list[str]:
    return [*args, f"data.source={corpus}", "data.text_column=text", "data.validation_docs=0"]


def test_the_tokenizer_trainer_never_touches_a_neighbour_or_a_users_directory(corpus, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a user's folder named like the old staging folder (<target>.tmp): it used to be deleted
    (tmp_path / "victim.tmp").mkdir()
    (tmp_path / "victim.tmp" / "thesis.txt").write_text("precious")
    tokenizer_cli.main(train(corpus, "victim", "--vocab-size", "256", "--max-docs", "200"))
    assert (tmp_path / "victim.tmp" / "thesis.txt").read_text() == "precious"
    assert (tmp_path / "victim" / "tokenizer.json").is_file()
    # into a non-empty folder of the user's: it used to crash (OSError: Directory not empty) leaving tokx.tmp
    (tmp_path / "tokx").mkdir()
    (tmp_path / "tokx" / "data.csv").write_text("a,b\n")
    for extra in ([], ["--overwrite"]):
        assert run_cli(tokenizer_cli.main, train(corpus, "tokx", "--vocab-size", "256", *extra)) == 2
        assert one_error_line(capsys.readouterr().err) == (
            "error: tokenizer directory tokx holds files that are not part of a tokenizer (data.csv): it is written "
            "only as a whole, never beside other files, --overwrite included; move them out or choose another "
            "tokenizer directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "tokx", "victim", "victim.tmp"]
    assert [p.name for p in (tmp_path / "tokx").iterdir()] == ["data.csv"]


def test_an_existing_tokenizer_or_export_is_never_kept_silently(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # an export (a 30,522-token BERT tokenizer beside the weights): it used to be "trained" by keeping it as it was
    export = tmp_path / "export"
    NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", max_length=64)).save_pretrained(
        export, tokenizer=load_tokenizer(max_length=64))
    before = tree(export)
    assert run_cli(tokenizer_cli.main, train(corpus, "export", "--vocab-size", "256", "--overwrite")) == 2
    assert one_error_line(capsys.readouterr().err).startswith(
        "error: tokenizer directory export holds files that are not part of a tokenizer (config.json, "
        "model.safetensors): it is written only as a whole")
    assert tree(export) == before
    # a tokenizer of its own: refused without --overwrite, replaced with it
    tokenizer_cli.main(train(corpus, "tok", "--vocab-size", "256"))
    assert run_cli(tokenizer_cli.main, train(corpus, "tok", "--vocab-size", "320")) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: tokenizer directory tok already holds a tokenizer (tokenizer.json, tokenizer_config.json): pass "
        "--overwrite to replace it, or choose another directory")
    assert len(load_tokenizer("tok")) == 256
    tokenizer_cli.main(train(corpus, "tok", "--kind", "bpe", "--vocab-size", "320", "--overwrite"))
    assert len(load_tokenizer("tok")) == 320 and load_tokenizer("tok").pad_token == "<pad>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "export", "tok"]


@pytest.mark.parametrize("args,message", [
    (["--vocab-size", "-5"], "--vocab-size -5: a wordpiece vocabulary needs at least 256 tokens (its 5 special "
                             "tokens and an alphabet) and at most 1,048,576"),
    (["--vocab-size", "0"], "--vocab-size 0: a wordpiece vocabulary needs at least 256 tokens"),
    (["--vocab-size", "3"], "--vocab-size 3: a wordpiece vocabulary needs at least 256 tokens"),
    (["--vocab-size", "100", "--kind", "bpe"], "--vocab-size 100: a bpe vocabulary needs at least 261 tokens (its 5 "
                                               "special tokens and the 256 bytes of its alphabet)"),
    (["--max-docs", "0"], "--max-docs 0: must be at least 1 (the documents the tokenizer learns from)"),
])
def test_a_vocabulary_size_or_document_count_out_of_range_is_one_line(corpus, tmp_path, capsys, monkeypatch,
                                                                      args, message):
    monkeypatch.chdir(tmp_path)
    assert run_cli(tokenizer_cli.main, train(corpus, "tok", *args)) == 2
    assert one_error_line(capsys.readouterr().err).startswith(f"error: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


def test_a_huge_vocabulary_is_refused_before_rust_aborts(corpus, tmp_path):
    # a subprocess: today's code aborts in Rust (status 134), which would take pytest down with it
    proc = subprocess.run([sys.executable, "-m", "experiments.train_tokenizer", str(tmp_path / "tok"),
                           *train(corpus, "--vocab-size", "100000000000")],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert one_error_line(proc.stderr) == (
        "error: --vocab-size 100000000000: a wordpiece vocabulary needs at least 256 tokens (its 5 special tokens "
        "and an alphabet) and at most 1,048,576")
    assert not (tmp_path / "tok").exists()


def test_an_alphabet_larger_than_the_vocabulary_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "cjk.jsonl"  # 400 distinct characters: a WordPiece vocabulary keeps its whole alphabet
    path.write_text("".join(json.dumps({"text": " ".join(chr(0x4E00 + i + k) for k in range(20))}) + "\n"
                            for i in range(0, 400, 20)))
    assert run_cli(tokenizer_cli.main, train(path, "tok", "--vocab-size", "300")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert re.fullmatch(r"error: --vocab-size 300 is smaller than the tokens the data needs: the 5 special tokens "
                        r"and the \d+ symbols of its alphabet \(\d+ tokens\); give at least \d+", line), line
    assert not (tmp_path / "tok").exists()


def test_no_documents_to_learn_from_is_a_data_error(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the wrong column: every document was skipped and a 5-token vocabulary written without a word
    assert run_cli(tokenizer_cli.main, ["tok", f"data.source={corpus}", "data.validation_docs=0"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: data.text_column='content' is not a column of the data; columns: ['text']")
    assert not (tmp_path / "tok").exists()


# ---------------------------------------------------------------------------------------------- 4. pretraining
def test_the_end_of_run_export_replaces_only_its_own_export(tmp_path):
    first = tiny_config(tmp_path / "a", "trainer.max_steps=2", f"export_dir={tmp_path / 'shared_export'}")
    run_pretraining(first)
    export = tmp_path / "shared_export"
    (export / AVERAGING_JSON).write_text("{}")  # e.g. `experiments.export --average` into it since
    before = tree(export)
    # another run's export: it used to replace its model.safetensors, keeping the stale averaging.json
    second = tiny_config(tmp_path / "b", "trainer.max_steps=2", f"export_dir={export}")
    with pytest.raises(ConfigError) as err:
        run_pretraining(second)
    assert str(err.value).startswith(
        f"invalid config key 'export_dir': {export} holds an export this run did not write (averaging.json, "
        f"config.json, model.safetensors, tokenizer.json, ...): choose another export_dir")
    assert tree(export) == before and not Path(second.output_dir).exists()  # refused before anything is written
    # the same run resumed: its own export (named by its checkpoint) is replaced whole, no stale averaging.json
    resumed = tiny_config(tmp_path / "a", "trainer.max_steps=4", f"export_dir={export}", "resume=true")
    run_pretraining(resumed)
    assert not (export / AVERAGING_JSON).exists()
    weights = torch.load(Path(resumed.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    assert weights["global_step"] == 4
    torch.testing.assert_close(load_file(export / "model.safetensors")["decoder.weight"],
                               weights["state_dict"]["model.decoder.weight"].float())


def test_the_export_inside_its_run_is_its_own_and_foreign_files_are_refused_first(tmp_path):
    config = tiny_config(tmp_path, "trainer.max_steps=2")
    run_pretraining(config)
    export = Path(config.output_dir) / "export"
    (export / AVERAGING_JSON).write_text("{}")
    run_pretraining(tiny_config(tmp_path, "trainer.max_steps=3", "resume=true"))
    assert not (export / AVERAGING_JSON).exists() and (export / "model.safetensors").is_file()
    (export / "README.md").write_text("my model card")
    checkpoints = tree(Path(config.output_dir) / "checkpoints")
    with pytest.raises(ConfigError, match=re.escape(
            f"invalid config key 'export_dir': {export} holds files that are not part of an export (README.md): it "
            f"is written only as a whole, never beside other files; move them out or choose another export_dir")):
        run_pretraining(tiny_config(tmp_path, "trainer.max_steps=4", "resume=true"))
    assert tree(Path(config.output_dir) / "checkpoints") == checkpoints  # refused before training
    assert (export / "README.md").read_text() == "my model card"
    # the run directory itself as the export: it used to write config.json and the weights among the checkpoints
    with pytest.raises(ConfigError, match=re.escape(
            f"invalid config key 'export_dir': {tmp_path / 'run'} holds this run's output_dir="
            f"'{tmp_path / 'run'}': the export goes into a directory of its own (by default output_dir/export)")):
        run_pretraining(tiny_config(tmp_path, "trainer.max_steps=4", "resume=true", f"export_dir={tmp_path / 'run'}"))


def test_pretokenize_never_mixes_its_shards_with_earlier_ones(tmp_path):
    config = tiny_config(tmp_path)
    shards = tmp_path / "shards"
    first = run_pretokenize(config, shards)
    (shards / "shard-00007.parquet").write_bytes(first[0].read_bytes())  # an earlier, longer pretokenization's
    before = tree(shards)
    with pytest.raises(ConfigError) as err:
        run_pretokenize(config, shards)
    assert str(err.value) == (
        f"pretokenize directory {shards} already holds shards of an earlier --pretokenize (shard-00000.parquet, "
        f"shard-00007.parquet): they would be read beside the new ones; remove them or choose another directory")
    assert tree(shards) == before
    # the directory of the corpus it reads
    with pytest.raises(ConfigError, match=re.escape(
            f"pretokenize directory {tmp_path} holds this command's input data.source='{tmp_path / 'corpus.jsonl'}'"
            f": an output never goes where its inputs are; choose another directory")):
        pretokenize(config.data, load_tokenizer(), tmp_path)


def test_the_phase_marker_is_one_of_the_exports_own_names():
    from neobert.outputs import EXPORT, PHASE_DONE_NAME

    assert PHASE_DONE == PHASE_DONE_NAME and PHASE_DONE in EXPORT.names


def test_a_staging_directory_is_new_and_beside_its_target(tmp_path):
    from neobert.outputs import staging_dir

    (tmp_path / "x.tmp").mkdir()
    first, second = staging_dir(tmp_path / "x"), staging_dir(tmp_path / "x")
    assert first != second and first.parent == tmp_path and first.is_dir() and not any(first.iterdir())
    assert (tmp_path / "x.tmp").is_dir() and not (tmp_path / "x").exists()
