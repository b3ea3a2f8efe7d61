"""GLUE fine-tuning on Lightning (NEOBERT_SPEC section 4): the typed run config, the DataModule, the
LightningModule with the paper's head, and the runs built from them (one run, the paper's grid, every task).

The same optimizer (AdamW, betas (0.9, 0.95)), schedule (6% warm-up, then linear decay) and head
([CLS] -> dropout -> dense -> tanh -> dropout -> classifier) for every backbone, so NeoBERT and any Hugging Face
encoder are compared under identical conditions. NeoBERT backbones use `NeoBERTForSequenceClassification`, so
the fine-tuned model exports in the hub layout.

Files of a task under `output_dir/<task>/`: one folder per run (`bs16_lr2e-05_wd0.01_seed0/` with the CSV log
`metrics.csv`, `config.yaml`, `results.json`), `best/` (the weights of the best run, the start point of
`transfer_from: mnli`), `results.json` (and `sweep.json`, `sweep.md` for a grid), `predictions/` when asked.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import math
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils.data import DataLoader, RandomSampler, Subset

from neobert.config import to_yaml
from neobert.data.glue import (GLUE_TASKS, HUB_DATASET, GlueCollator, GlueTask, LengthGroupedSampler,
                               TokenizedGlue, get_task, load_glue_split)
from neobert.eval.glue_metrics import GlueMetrics, main_score_key, predictions, table3_markdown
from neobert.hub import HubUnreachableError, hub_reachable
from neobert.lit.optim import build_adamw, warmup_linear
from neobert.model.backbone import Backbone, load_backbone
from neobert.model.modeling import NeoBERTForSequenceClassification, SequenceClassifierOutput, classification_loss

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
TRANSFER_HEAD_PREFIX = "classifier."  # re-initialised on transfer: the label sets differ (MNLI has 3 labels)


# ------------------------------------------------------------------------------------------------ config
@dataclass
class GlueDataConfig:
    path: Optional[str] = None  # local GLUE files (hub parquet or original TSV layout); None = the hub's nyu-mll/glue
    max_length: int = 1024  # the paper's NeoBERT value; clipped to what the tokenizer/model accepts
    batch_size: int = 16
    eval_batch_size: int = 64
    group_by_length: bool = True  # length-grouped batches: short sentences do not pay for long ones
    num_workers: int = 0
    max_train_examples: int = 0  # 0 = all; otherwise a seeded random subset (quick runs)
    max_eval_examples: int = 0  # 0 = all; otherwise the first N of each validation split


@dataclass
class GlueOptimConfig:
    lr: float = 2e-5
    weight_decay: float = 1e-2
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # the paper's code
    eps: float = 1e-8
    warmup_fraction: float = 0.06  # then linear decay to 0
    gradient_clip_val: float = 1.0


@dataclass
class GlueTrainerConfig:
    max_epochs: int = 10
    max_steps: int = -1  # > 0 caps the run (and sets the schedule's length)
    eval_every_n_steps: int = 500  # validation every n training steps, across epochs
    early_stopping_patience: int = 5  # evaluations without improvement before stopping; 0 = off
    accelerator: str = "auto"
    devices: int = 1
    precision: str = "32-true"  # "bf16-mixed" on GPUs
    seed: int = 0
    log_every_n_steps: int = 50
    enable_progress_bar: bool = True


@dataclass
class GlueSweepConfig:
    """The paper's grid. Every (batch size, lr, weight decay) runs once per seed; the median over seeds ranks it."""

    batch_sizes: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])
    lrs: list[float] = field(default_factory=lambda: [5e-6, 6e-6, 8e-6, 1e-5, 2e-5, 3e-5])
    weight_decays: list[float] = field(default_factory=lambda: [1e-2, 1e-5])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])


@dataclass
class GlueConfig:
    task: str = "rte"
    model: str = "chandar-lab/NeoBERT"  # our export, a local HF directory, a hub name, or preset:tiny
    tokenizer: Optional[str] = None  # default: the one beside the model
    classifier_dropout: float = 0.1
    # "mnli": start from the best MNLI model under output_dir (the paper does this for RTE, MRPC, STS-B);
    # or a directory holding a fine-tuned model.safetensors of the same backbone.
    transfer_from: Optional[str] = None
    output_dir: Optional[str] = None  # default: runs/glue/<model name>, so transfers never mix backbones
    predict: bool = False  # write test-split predictions of the best model (GLUE submission TSVs)
    keep_run_checkpoints: bool = False  # the per-run best checkpoints; the task's best model is always kept
    data: GlueDataConfig = field(default_factory=GlueDataConfig)
    optim: GlueOptimConfig = field(default_factory=GlueOptimConfig)
    trainer: GlueTrainerConfig = field(default_factory=GlueTrainerConfig)
    sweep: GlueSweepConfig = field(default_factory=GlueSweepConfig)


# ------------------------------------------------------------------------------------------------ model
class BackboneForSequenceClassification(nn.Module):
    """The paper's head on any Hugging Face encoder, with the same layer names as NeoBERT's classifier."""

    def __init__(self, backbone: Backbone, num_labels: int, classifier_dropout: float = 0.1,
                 init_range: float = 0.02):
        super().__init__()
        self.backbone = backbone
        self.num_labels = num_labels
        self.dense = nn.Linear(backbone.hidden_size, backbone.hidden_size)
        self.classifier = nn.Linear(backbone.hidden_size, num_labels)
        self.head_dropout = nn.Dropout(classifier_dropout)
        for layer in (self.dense, self.classifier):
            nn.init.normal_(layer.weight, mean=0.0, std=init_range)
            nn.init.zeros_(layer.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> SequenceClassifierOutput:
        # Pair tasks: BERT-style encoders were pretrained with segment embeddings, so they get them.
        hidden = self.backbone(input_ids, attention_mask, token_type_ids)
        x = self.head_dropout(hidden[:, 0])
        x = self.head_dropout(torch.tanh(self.dense(x)))
        logits = self.classifier(x)
        loss = None if labels is None else classification_loss(logits, labels, self.num_labels)
        return SequenceClassifierOutput(logits, loss, hidden)


def build_classifier(backbone: Backbone, num_labels: int, classifier_dropout: float = 0.1) -> nn.Module:
    """NeoBERT backbones -> NeoBERTForSequenceClassification (exports in the hub layout); others -> the same head
    on the Hugging Face encoder. The encoder is reused, not copied. Returned in train mode: `from_pretrained`
    leaves Hugging Face models in eval mode, and Lightning keeps each module's mode, which would silently
    switch dropout off for the encoder."""
    if backbone.is_neobert:
        config = dataclasses.replace(backbone.encoder.config, num_labels=num_labels,
                                     classifier_dropout=classifier_dropout)
        model = NeoBERTForSequenceClassification(config)
        model.model = backbone.encoder
    else:
        model = BackboneForSequenceClassification(backbone, num_labels, classifier_dropout)
    return model.train()


def model_inputs(batch: dict, model: nn.Module) -> dict:
    """The batch keys `model` takes: token_type_ids for Hugging Face encoders only (NeoBERT has no segments)."""
    keys = ["input_ids", "attention_mask"]
    if isinstance(model, BackboneForSequenceClassification) and "token_type_ids" in batch:
        keys.append("token_type_ids")
    return {k: batch[k] for k in keys}


def load_transfer_weights(model: nn.Module, directory: str | Path) -> None:
    """Loads a fine-tuned model (e.g. MNLI) into `model`: everything but the classifier layer, which stays freshly
    initialised because the label sets differ. Any other mismatch means a different backbone: an error."""
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"transfer_from: {path} does not exist. Fine-tune that task first with the same model and output_dir "
            f"(it keeps its best model in <output_dir>/<task>/best/), or set transfer_from=null")
    state = {k: v for k, v in load_file(str(path)).items() if not k.startswith(TRANSFER_HEAD_PREFIX)}
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith(TRANSFER_HEAD_PREFIX)}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = [k for k in set(state) & set(expected) if state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"transfer_from: {path} was not fine-tuned from this backbone (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, mis-shaped {shapes[:5]})")
    model.load_state_dict(state, strict=False)
    log.info("transferred all but the classifier layer from %s", path)


# ------------------------------------------------------------------------------------------------ Lightning
class GlueDataModule(L.LightningDataModule):
    """Train and validation splits (and test splits for prediction) of one task, tokenized once; `batch_size`
    and `seed` may change between runs of a sweep without reloading anything."""

    def __init__(self, task: GlueTask, tokenizer, config: GlueDataConfig, seed: int = 0):
        super().__init__()
        self.task, self.tokenizer, self.config = task, tokenizer, config
        self.batch_size, self.seed = config.batch_size, seed
        limit = getattr(tokenizer, "model_max_length", None) or config.max_length
        self.max_length = min(config.max_length, limit)
        if self.max_length < config.max_length:
            log.info("data.max_length=%d clipped to the tokenizer's limit %d", config.max_length, self.max_length)
        self.collator = GlueCollator(tokenizer.pad_token_id)
        self.train: Optional[TokenizedGlue] = None
        self.validation: dict[str, Subset] = {}
        self.test: dict[str, Subset] = {}

    def _tokenized(self, split: str, limit: int, shuffle_seed: Optional[int] = None) -> TokenizedGlue:
        dataset = load_glue_split(self.task, split, self.config.path)
        if limit and limit < len(dataset):
            dataset = (dataset.shuffle(seed=shuffle_seed) if shuffle_seed is not None else dataset).select(range(limit))
        return TokenizedGlue(self.task, split, dataset, self.tokenizer, self.max_length)

    @staticmethod
    def _by_length(dataset: TokenizedGlue) -> Subset:
        # Evaluation order does not change any metric; sorting by length minimises padding.
        lengths = dataset.lengths()
        return Subset(dataset, sorted(range(len(dataset)), key=lengths.__getitem__))

    def setup(self, stage: Optional[str] = None) -> None:
        if stage in (None, "fit") and self.train is None:
            self.train = self._tokenized("train", self.config.max_train_examples, shuffle_seed=0)
        if stage in (None, "fit", "validate") and not self.validation:
            self.validation = {s: self._by_length(self._tokenized(s, self.config.max_eval_examples))
                               for s in self.task.validation_splits}
        if stage == "predict" and not self.test:
            self.test = {s: self._by_length(self._tokenized(s, 0)) for s in self.task.test_splits}

    def train_dataloader(self) -> DataLoader:
        if self.config.group_by_length:
            sampler = LengthGroupedSampler(self.train.lengths(), self.batch_size, seed=self.seed)
        else:
            sampler = RandomSampler(self.train, generator=torch.Generator().manual_seed(self.seed))
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collator,
                          num_workers=self.config.num_workers)

    def _eval_loaders(self, datasets: dict[str, Subset]) -> list[DataLoader]:
        return [DataLoader(d, batch_size=self.config.eval_batch_size, collate_fn=self.collator,
                           num_workers=self.config.num_workers) for d in datasets.values()]

    def val_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.validation)

    def predict_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.test)

    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train) / self.batch_size)


class GlueClassifier(L.LightningModule):
    """Fine-tunes `model` (from build_classifier) on one task. Logs `train/loss`, `val/<metric>` and `val/score`
    (the task's main metric, which picks the best checkpoint); `best_scores` holds the metrics at the best step."""

    def __init__(self, task: GlueTask, model: nn.Module, optim: GlueOptimConfig):
        super().__init__()
        self.task, self.model, self.optim = task, model, optim
        self.metrics = GlueMetrics(task)
        self.best_scores: dict[str, float] = {}
        self.best_step = -1

    def forward(self, batch: dict) -> SequenceClassifierOutput:
        return self.model(**model_inputs(batch, self.model), labels=batch.get("labels"))

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self(batch).loss
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        logits = self.model(**model_inputs(batch, self.model)).logits
        self.metrics.update(self.task.validation_splits[dataloader_idx], logits, batch["labels"])

    def on_validation_epoch_end(self) -> None:
        scores = self.metrics.compute()
        self.metrics.reset()
        score = scores[main_score_key(self.task)]
        for name, value in scores.items():
            self.log(f"val/{name}", value, sync_dist=True)
        self.log("val/score", score, prog_bar=True, sync_dist=True)
        if not self.trainer.sanity_checking and (not self.best_scores or score > self.best_scores["score"]):
            self.best_scores = {**scores, "score": score}
            self.best_step = self.global_step

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> dict:
        logits = self.model(**model_inputs(batch, self.model)).logits
        return {"idx": batch["idx"], "prediction": predictions(self.task, logits)}

    def configure_optimizers(self):
        optimizer = build_adamw(self.model, self.optim.lr, self.optim.weight_decay, self.optim.betas,
                                self.optim.eps)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(self.optim.warmup_fraction * total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear(warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------------------------------------ runs
def output_root(config: GlueConfig) -> Path:
    if config.output_dir:
        return Path(config.output_dir)
    return Path("runs/glue") / config.model.strip("/").replace("/", "--").replace(":", "-")


def run_name(batch_size: int, lr: float, weight_decay: float, seed: int) -> str:
    return f"bs{batch_size}_lr{lr:g}_wd{weight_decay:g}_seed{seed}"


def transfer_directory(config: GlueConfig) -> Optional[Path]:
    if config.transfer_from is None:
        return None
    if config.transfer_from in GLUE_TASKS:
        return output_root(config) / config.transfer_from / "best"
    return Path(config.transfer_from)


def fine_tune(config: GlueConfig, datamodule: GlueDataModule, backbone_source: Backbone, run_dir: Path) -> dict:
    """One fine-tuning run: seeded head, Lightning Trainer with validation every n steps, early stopping and the
    best weights kept in `run_dir/checkpoints/best.ckpt`. Returns the run's result record."""
    task = datamodule.task
    L.seed_everything(config.trainer.seed, workers=True, verbose=False)
    datamodule.batch_size, datamodule.seed = config.data.batch_size, config.trainer.seed
    datamodule.setup("fit")
    # Each run starts from the pretrained weights, never from a previous run's.
    model = build_classifier(copy.deepcopy(backbone_source), task.num_labels, config.classifier_dropout)
    source = transfer_directory(config)
    if source is not None:
        load_transfer_weights(model, source)
    module = GlueClassifier(task, model, config.optim)

    total_steps = datamodule.steps_per_epoch() * config.trainer.max_epochs
    if config.trainer.max_steps > 0:
        total_steps = min(total_steps, config.trainer.max_steps)
    eval_every = max(1, min(config.trainer.eval_every_n_steps, total_steps))
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=run_dir / "checkpoints", filename="best", monitor="val/score", mode="max", save_top_k=1,
        save_weights_only=True, auto_insert_metric_name=False)
    callbacks: list[L.Callback] = [checkpoint, L.pytorch.callbacks.LearningRateMonitor("step")]
    if config.trainer.early_stopping_patience > 0:
        callbacks.append(L.pytorch.callbacks.EarlyStopping(
            monitor="val/score", mode="max", patience=config.trainer.early_stopping_patience))
    trainer = L.Trainer(
        accelerator=config.trainer.accelerator, devices=config.trainer.devices, precision=config.trainer.precision,
        max_epochs=config.trainer.max_epochs, max_steps=config.trainer.max_steps,
        val_check_interval=eval_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        gradient_clip_val=config.optim.gradient_clip_val or None, callbacks=callbacks,
        logger=L.pytorch.loggers.CSVLogger(run_dir, name="", version=""),
        log_every_n_steps=min(config.trainer.log_every_n_steps, eval_every),
        enable_progress_bar=config.trainer.enable_progress_bar, enable_model_summary=False,
        default_root_dir=run_dir)
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    if not module.best_scores:
        raise RuntimeError(f"{run_dir}: no validation ran (eval_every_n_steps={eval_every})")
    result = {
        "task": task.name, "model": config.model, "run": run_dir.name, "batch_size": config.data.batch_size,
        "lr": config.optim.lr, "weight_decay": config.optim.weight_decay, "seed": config.trainer.seed,
        "transfer_from": config.transfer_from, "best_step": module.best_step, "steps": trainer.global_step,
        "train_seconds": time.perf_counter() - start, "scores": module.best_scores,
        "checkpoint": checkpoint.best_model_path,
    }
    (run_dir / "config.yaml").write_text(to_yaml(config))  # after fit: the CSV logger wants an empty folder
    (run_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def export_best(result: dict, config: GlueConfig, datamodule: GlueDataModule, backbone_source: Backbone,
                directory: Path) -> nn.Module:
    """Writes the best run's weights to `directory` (hub layout for NeoBERT, plus the tokenizer) and returns the
    loaded model."""
    task = datamodule.task
    model = build_classifier(copy.deepcopy(backbone_source), task.num_labels, config.classifier_dropout)
    state = torch.load(result["checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    if directory.exists():
        shutil.rmtree(directory)
    if isinstance(model, NeoBERTForSequenceClassification):
        model.save_pretrained(directory, tokenizer=datamodule.tokenizer)
    else:
        directory.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / WEIGHTS_NAME))
        datamodule.tokenizer.save_pretrained(str(directory))
    meta = {k: result[k] for k in ("task", "model", "run", "scores", "transfer_from")}
    (directory / "glue_run.json").write_text(json.dumps(meta, indent=2) + "\n")
    return model


def write_predictions(config: GlueConfig, datamodule: GlueDataModule, model: nn.Module, directory: Path) -> None:
    """Test-split predictions in the GLUE submission layout: `index<TAB>prediction`, label names for NLI tasks."""
    task = datamodule.task
    datamodule.setup("predict")
    trainer = L.Trainer(accelerator=config.trainer.accelerator, devices=1, precision=config.trainer.precision,
                        logger=False, enable_progress_bar=config.trainer.enable_progress_bar,
                        enable_model_summary=False)
    outputs = trainer.predict(GlueClassifier(task, model, config.optim), datamodule=datamodule)
    if len(task.test_splits) == 1:
        outputs = [outputs]
    names = {v: k for k, v in task.tsv_label_map.items()} if task.tsv_label_map else None
    directory.mkdir(parents=True, exist_ok=True)
    for split, batches in zip(task.test_splits, outputs):
        rows = sorted((int(i), p) for b in batches for i, p in zip(b["idx"], b["prediction"].tolist()))
        lines = ["index\tprediction"] + [
            f"{i}\t{names[p] if names else (f'{p:.3f}' if task.is_regression else p)}" for i, p in rows]
        (directory / f"{split}.tsv").write_text("\n".join(lines) + "\n")


def check_hub_sources(config: GlueConfig) -> None:
    """Before any work: when the hub is unreachable, name every config key that would need it."""
    needs_hub = []
    if config.data.path is None:
        needs_hub.append(f"`data.path` (GLUE {config.task} would come from the hub's {HUB_DATASET})")
    if not (config.model.startswith("preset:") or Path(config.model).exists()):
        needs_hub.append(f"`model` ({config.model!r} would be downloaded)")
    if needs_hub and not hub_reachable():
        raise HubUnreachableError(
            "the Hugging Face hub cannot be reached (or HF_HUB_OFFLINE is set), so set " + " and ".join(needs_hub)
            + f" to local files. GLUE files: `data.path=/data/glue` holding either the hub's parquet layout "
            f"(/data/glue/{config.task}/train.parquet, validation.parquet, ...) or the original GLUE TSV layout "
            f"(/data/glue/{config.task}/train.tsv, dev.tsv, ...); model: a local directory or --model preset:tiny.")


def run_task(config: GlueConfig, sweep: bool = False) -> dict:
    """Fine-tunes one task: a single run with the config's hyperparameters, or (sweep=True) the grid with
    several seeds, ranked by the median over seeds. Keeps the best run's model in `<output_dir>/<task>/best/`."""
    task = get_task(config.task)
    check_hub_sources(config)
    task_dir = output_root(config) / task.name
    backbone = load_backbone(config.model, tokenizer=config.tokenizer)
    datamodule = GlueDataModule(task, backbone.tokenizer, config.data, seed=config.trainer.seed)
    if sweep:
        grid = list(itertools.product(config.sweep.batch_sizes, config.sweep.lrs, config.sweep.weight_decays))
        seeds = config.sweep.seeds
    else:
        grid = [(config.data.batch_size, config.optim.lr, config.optim.weight_decay)]
        seeds = [config.trainer.seed]
    runs, best = [], None
    for (batch_size, lr, weight_decay), seed in itertools.product(grid, seeds):
        run_config = copy.deepcopy(config)
        run_config.data.batch_size, run_config.optim.lr = batch_size, lr
        run_config.optim.weight_decay, run_config.trainer.seed = weight_decay, seed
        result = fine_tune(run_config, datamodule, backbone, task_dir / run_name(batch_size, lr, weight_decay, seed))
        runs.append(result)
        if best is None or result["scores"]["score"] > best["scores"]["score"]:
            best = result
            best_model = export_best(result, run_config, datamodule, backbone, task_dir / "best")
        if not config.keep_run_checkpoints:
            shutil.rmtree(Path(result["checkpoint"]).parent, ignore_errors=True)
    summary = summarize_runs(task, runs)
    summary["best_run"] = best["run"]
    (task_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    if sweep:
        (task_dir / "sweep.json").write_text(json.dumps(runs, indent=2) + "\n")
        (task_dir / "sweep.md").write_text(sweep_markdown(task, summary))
    if config.predict:
        write_predictions(config, datamodule, best_model, task_dir / "predictions")
    return summary


def summarize_runs(task: GlueTask, runs: list[dict]) -> dict:
    """Groups runs by hyperparameters; each group's score is the median over its seeds (every metric, separately);
    the task's result is the group with the best median main score."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["batch_size"], run["lr"], run["weight_decay"]), []).append(run)
    table = []
    for (batch_size, lr, weight_decay), members in groups.items():
        medians = {k: statistics.median(r["scores"][k] for r in members) for k in members[0]["scores"]}
        table.append({"batch_size": batch_size, "lr": lr, "weight_decay": weight_decay,
                      "seeds": [r["seed"] for r in members], "median": medians,
                      "per_seed": [r["scores"]["score"] for r in members]})
    table.sort(key=lambda row: row["median"]["score"], reverse=True)
    return {"task": task.name, "model": runs[0]["model"], "scores": table[0]["median"],
            "hyperparameters": {k: table[0][k] for k in ("batch_size", "lr", "weight_decay")},
            "grid": table, "train_seconds": sum(r["train_seconds"] for r in runs)}


def sweep_markdown(task: GlueTask, summary: dict) -> str:
    key = main_score_key(task)
    lines = [f"# {task.name}: grid ranked by the median {key} over seeds", "",
             "| batch | lr | weight decay | median | per seed |", "|---|---|---|---|---|"]
    for row in summary["grid"]:
        per_seed = ", ".join(f"{100 * s:.1f}" for s in row["per_seed"])
        lines.append(f"| {row['batch_size']} | {row['lr']:g} | {row['weight_decay']:g} | "
                     f"{100 * row['median']['score']:.1f} | {per_seed} |")
    return "\n".join(lines) + "\n"


# MNLI first: RTE, MRPC and STS-B can start from its fine-tuned model (`transfer_from: mnli`).
ALL_TASKS = ("mnli", "qnli", "qqp", "sst2", "cola", "mrpc", "stsb", "rte", "wnli")


def run_all(configs: dict[str, GlueConfig], sweep: bool = False) -> dict:
    """Every task in `configs` (in ALL_TASKS order), then one results table in the paper's Table 3 layout:
    `<output_dir>/glue_results.json` and `.md` (output_dir of the first task's config)."""
    order = [t for t in ALL_TASKS if t in configs]
    results = {task: run_task(configs[task], sweep=sweep) for task in order}
    output_dir = output_root(configs[order[0]])
    model = configs[order[0]].model
    (output_dir / "glue_results.json").write_text(json.dumps({"model": model, "tasks": results}, indent=2) + "\n")
    (output_dir / "glue_results.md").write_text(table3_markdown(model, {t: r["scores"] for t, r in results.items()}))
    return results
