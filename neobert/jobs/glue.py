"""GLUE fine-tuning runs (paper Table 3 and the fine-tuning appendix; docs/glue.md): one run, the paper's grid
with several seeds, every task, and the files they write.

Files of a task under `output_dir/<task>/`: one folder per run (`bs16_lr2e-05_wd0.01_seed0/` with the CSV log
`logs/version_0/metrics.csv`, `config.yaml`, `results.json`), `best/` (the weights of the best run, the start
point of `transfer_from: mnli`), `results.json` (and `sweep.json`, `sweep.md` for a grid), `predictions/` when
asked. `--task all` adds `glue_results.json` and `.md` (the paper's Table 3 layout) under `output_dir`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

from safetensors.torch import save_file
from torch import nn

from neobert.config import ConfigError
from neobert.config.glue import GlueConfig
from neobert.data.backbone import Backbone, model_needs_hub
from neobert.data.glue import GLUE_TASKS, HUB_DATASET, GlueTask, get_task, task_directory
from neobert.data.glue_datamodule import GlueDataModule
from neobert.eval.glue_metrics import main_score_key, table3_markdown
from neobert.hub import HubUnreachableError, hub_reachable
from neobert.jobs import finetune
from neobert.jobs.finetune import FineTuneJob, fit_keeping_best, load_best_weights
from neobert.layout import (GLUE_BEST_DIR, GLUE_PREDICTIONS_DIR, GLUE_RUN_INFO, GLUE_TABLE_JSON, GLUE_TABLE_MD,
                            WEIGHTS_NAME)
from neobert.lit.glue import GlueClassifier, build_classifier, load_transfer_weights
from neobert.lit.trainer import build_trainer
from neobert.model.modeling import NeoBERTForSequenceClassification

# MNLI first: RTE, MRPC and STS-B can start from its fine-tuned model (`transfer_from: mnli`).
ALL_TASKS = ("mnli", "qnli", "qqp", "sst2", "cola", "mrpc", "stsb", "rte", "wnli")


def run_glue(task: str, config: str | Path | None = None, model: str | None = None, overrides: Sequence[str] = (),
             sweep: bool = False) -> dict:
    """What `python -m experiments.glue` runs: one task (its summary), or `task="all"` (every task in ALL_TASKS
    order, each from its packaged config; a summary per task)."""
    if task != "all":
        return run_task(load_task_config(task, config, model, overrides), sweep=sweep)
    if config:
        raise ConfigError("--task all uses the packaged glue/<task> config of each task; pass key=value "
                          "overrides instead of --config")
    return run_all({name: load_task_config(name, None, model, overrides) for name in ALL_TASKS}, sweep=sweep)


def transfer_directory(config: GlueConfig) -> Optional[Path]:
    if config.transfer_from is None:
        return None
    if config.transfer_from in GLUE_TASKS:
        return GLUE.output_root(config) / config.transfer_from / GLUE_BEST_DIR
    return Path(config.transfer_from)


def fine_tune(config: GlueConfig, datamodule: GlueDataModule, backbone_source: Backbone, run_dir: Path) -> dict:
    """One fine-tuning run (seeded, its data set up, by `finetune.run_task`): a fresh head, validation every n steps,
    early stopping and the best weights kept in `run_dir/checkpoints/best.ckpt`. Returns the run's result record."""
    task = datamodule.task
    # Each run starts from the pretrained weights, never from a previous run's.
    model = build_classifier(copy.deepcopy(backbone_source), task.num_labels, config.classifier_dropout)
    source = transfer_directory(config)
    if source is not None:
        load_transfer_weights(model, source)
    module = GlueClassifier(task, model, config.optimizer, config.scheduler)
    trainer, checkpoint, seconds = fit_keeping_best(config, module, datamodule, run_dir)
    return {
        "task": task.name, "model": config.model, "run": run_dir.name, "batch_size": config.data.batch_size,
        "lr": config.optimizer.lr, "weight_decay": config.optimizer.weight_decay, "seed": config.trainer.seed,
        "transfer_from": config.transfer_from, "best_step": module.best_step, "steps": trainer.global_step,
        "train_seconds": seconds, "scores": module.best_scores,
        "checkpoint": checkpoint.best_model_path,
    }


def export_best(result: dict, config: GlueConfig, datamodule: GlueDataModule, backbone_source: Backbone,
                directory: Path) -> nn.Module:
    """Writes the best run's weights to `directory` (hub layout for NeoBERT, plus the tokenizer) and returns the
    loaded model."""
    task = datamodule.task
    model = build_classifier(copy.deepcopy(backbone_source), task.num_labels, config.classifier_dropout)
    load_best_weights(model, result["checkpoint"])
    if directory.exists():
        shutil.rmtree(directory)
    if isinstance(model, NeoBERTForSequenceClassification):
        model.save_pretrained(directory, tokenizer=datamodule.tokenizer)
    else:
        directory.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / WEIGHTS_NAME))
        datamodule.tokenizer.save_pretrained(str(directory))
    meta = {k: result[k] for k in ("task", "model", "run", "scores", "transfer_from")}
    (directory / GLUE_RUN_INFO).write_text(json.dumps(meta, indent=2) + "\n")
    return model


def write_predictions(config: GlueConfig, datamodule: GlueDataModule, model: nn.Module, directory: Path) -> None:
    """Test-split predictions in the GLUE submission layout: `index<TAB>prediction`, label names for NLI tasks."""
    task = datamodule.task
    datamodule.setup("predict")
    trainer = build_trainer(dataclasses.replace(config.trainer, devices=1), config.logging, None, validate=False)
    outputs = trainer.predict(GlueClassifier(task, model, config.optimizer, config.scheduler), datamodule=datamodule)
    if len(task.test_splits) == 1:
        outputs = [outputs]
    names = {v: k for k, v in task.tsv_label_map.items()} if task.tsv_label_map else None
    directory.mkdir(parents=True, exist_ok=True)
    for split, batches in zip(task.test_splits, outputs):
        rows = sorted((int(i), p) for b in batches for i, p in zip(b["idx"], b["prediction"].tolist()))
        lines = ["index\tprediction"] + [
            f"{i}\t{names[p] if names else (f'{p:.3f}' if task.is_regression else p)}" for i, p in rows]
        (directory / f"{split}.tsv").write_text("\n".join(lines) + "\n")


def check_hub_sources(config: GlueConfig, task: GlueTask) -> None:
    """Before any work: when the hub is unreachable, name every config key that would need it."""
    needs_hub = []
    if config.data.path is None:
        needs_hub.append(f"`data.path` (GLUE {task.name} would come from the hub's {HUB_DATASET})")
    if model_needs_hub(config.model):  # a missing path-like model is a ConfigError here, not a download
        needs_hub.append(f"`model` ({config.model!r} would be downloaded)")
    if needs_hub and not hub_reachable():
        raise HubUnreachableError(
            "the Hugging Face hub cannot be reached (or HF_HUB_OFFLINE is set), so set " + " and ".join(needs_hub)
            + f" to local files. GLUE files: `data.path=/data/glue` holding either the hub's parquet layout "
            f"(/data/glue/{task.name}/train.parquet, validation.parquet, ...) or the original GLUE TSV layout "
            f"(/data/glue/{task.name}/train.tsv, dev.tsv, ...); model: a local directory or --model preset:tiny.")


def run_inputs(config: GlueConfig, task: GlueTask) -> list[tuple[str, str | Path | None]]:
    """What a run reads (its task directory must not hold any of it): the task's data files, the model, its
    tokenizer and the model it transfers from."""
    inputs = [(f"data.path={config.data.path!r}", config.data.path), (f"model={config.model!r}", config.model),
              (f"tokenizer={config.tokenizer!r}", config.tokenizer)]
    if config.data.path is not None and Path(config.data.path).is_dir():
        data = task_directory(task, Path(config.data.path))
        inputs.append((f"{data} (the {task.name} files of data.path={config.data.path!r})", data))
    transfer = transfer_directory(config)
    return inputs + ([(f"transfer_from={config.transfer_from!r} ({transfer})", transfer)] if transfer else [])


def finish_task(config: GlueConfig, run: finetune.TaskRun) -> None:
    """The test-split predictions of the best model, when `predict` is set (in the task directory, still held)."""
    if config.predict:
        write_predictions(config, run.datamodule, run.best_model, run.task_dir / GLUE_PREDICTIONS_DIR)


GLUE = FineTuneJob(name="glue", config_class=GlueConfig, get_task=get_task, datamodule=GlueDataModule,
                   check_hub_sources=check_hub_sources, run_inputs=run_inputs, fine_tune=fine_tune,
                   export_best=export_best, score_name=main_score_key, finish=finish_task)
load_task_config = GLUE.load_task_config


def run_task(config: GlueConfig, sweep: bool = False) -> dict:
    """Fine-tunes one task (`finetune.run_task`: one run or the grid with its seeds, the best model kept in
    `<output_dir>/<task>/best/`), then writes its test-split predictions when `predict` is set (`finish_task`)."""
    return finetune.run_task(GLUE, config, sweep).summary


def run_all(configs: dict[str, GlueConfig], sweep: bool = False) -> dict:
    """Every task in `configs` (in ALL_TASKS order), then one results table in the paper's Table 3 layout:
    `<output_dir>/glue_results.json` and `.md` (output_dir of the first task's config)."""
    order = [t for t in ALL_TASKS if t in configs]
    results = {task: run_task(configs[task], sweep=sweep) for task in order}
    output_dir = GLUE.output_root(configs[order[0]])
    model = configs[order[0]].model
    (output_dir / GLUE_TABLE_JSON).write_text(json.dumps({"model": model, "tasks": results}, indent=2) + "\n")
    (output_dir / GLUE_TABLE_MD).write_text(table3_markdown(model, {t: r["scores"] for t, r in results.items()}))
    return results
