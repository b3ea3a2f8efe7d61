"""Token classification (NER) fine-tuning runs (docs/ner.md): one run or the paper's grid with seeds (the
machinery of `neobert.jobs.finetune`, shared with GLUE), the best model exported, and the files they write.

Scores are entity-level precision, recall and F1 (seqeval) on the validation (dev) split, which also picks the
best checkpoint: the local WNUT-17 files hold no test split. Files under `output_dir/<task>/`: one folder per run
(`bs32_lr5e-05_wd0.01_seed0/` with `logs/version_0/metrics.csv`, `config.yaml`, `results.json`), `best/` (the
best run's model: loads with `AutoModelForTokenClassification`, its `config.json` naming the tags in `id2label`),
`results.json` (and `sweep.json`, `sweep.md` for a grid).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import lightning as L
from torch import nn

from neobert.config import load_config
from neobert.config.ner import NerConfig
from neobert.data.backbone import Backbone, load_backbone, model_needs_hub
from neobert.data.ner import NerDataModule, NerTask, get_ner_task, uses_hub
from neobert.hub import HubUnreachableError, hub_reachable
from neobert.jobs.finetune import (fit_keeping_best, load_best_weights, prepare_task_dir, run_grid, summarize_runs,
                                   write_summary)
from neobert.layout import CONFIG_NAME, GLUE_BEST_DIR, NER_RUN_INFO, RESULTS_JSON
from neobert.lit.ner import NerTagger, build_token_classifier
from neobert.model.modeling import NeoBERTForTokenClassification

DEFAULT_OUTPUT_ROOT = Path("runs/ner")
EVALUATED_ON = "validation"  # the dev split: model selection and the reported scores (no test split locally)


def load_task_config(task: str, config: str | Path | None = None, model: str | None = None,
                     overrides: Sequence[str] = ()) -> NerConfig:
    """`config` (a path or packaged name; default the packaged `ner/<task>`), the overrides, then task and model."""
    extra = [f"task={task}"] + ([f"model={model}"] if model else [])
    return load_config(NerConfig, config or f"ner/{task}", [*overrides, *extra])


def run_ner(task: str, config: str | Path | None = None, model: str | None = None, overrides: Sequence[str] = (),
            sweep: bool = False) -> dict:
    """What `python -m experiments.ner` runs."""
    return run_task(load_task_config(task, config, model, overrides), sweep=sweep)


def output_root(config: NerConfig) -> Path:
    if config.output_dir:
        return Path(config.output_dir)
    return DEFAULT_OUTPUT_ROOT / config.model.strip("/").replace("/", "--").replace(":", "-")


def check_hub_sources(config: NerConfig, task: NerTask) -> None:
    """Before any work: when the hub is unreachable, name every config key that would need it."""
    needs_hub = []
    if any(uses_hub(config.data, split) for split in ("train", "validation")):
        needs_hub.append(f"`data.path` ({task.name} would come from the hub's {task.hub_dataset})")
    if model_needs_hub(config.model):  # a missing path-like model is a ConfigError here, not a download
        needs_hub.append(f"`model` ({config.model!r} would be downloaded)")
    if needs_hub and not hub_reachable():
        raise HubUnreachableError(
            "the Hugging Face hub cannot be reached (or HF_HUB_OFFLINE is set), so set " + " and ".join(needs_hub)
            + f" to local files: `data.path=/data/{task.name}` holding train.conll and dev.conll (one "
            "`token<TAB>tag` per line, a blank line between sentences), or `data.files.train=... "
            "data.files.validation=...`; model: a local directory or --model preset:tiny.")


def fine_tune(config: NerConfig, datamodule: NerDataModule, backbone: Backbone, run_dir: Path) -> dict:
    """One run: a seeded fresh head on the pretrained weights, validation every n steps, early stopping, the best
    weights kept in `run_dir/checkpoints/best.ckpt`. Returns the run's result record."""
    task = datamodule.task
    L.seed_everything(config.trainer.seed, workers=True, verbose=False)
    datamodule.batch_size, datamodule.seed = config.data.batch_size, config.trainer.seed
    datamodule.setup("fit")
    model = build_token_classifier(backbone, task, config.classifier_dropout)
    module = NerTagger(task, model, config.optimizer, config.scheduler, datamodule.validation)
    trainer, checkpoint, seconds = fit_keeping_best(config, module, datamodule, run_dir)
    result = {
        "task": task.name, "model": config.model, "run": run_dir.name, "batch_size": config.data.batch_size,
        "lr": config.optimizer.lr, "weight_decay": config.optimizer.weight_decay, "seed": config.trainer.seed,
        "evaluated_on": EVALUATED_ON, "best_step": module.best_step, "steps": trainer.global_step,
        "train_seconds": seconds, "scores": module.best_scores, "checkpoint": checkpoint.best_model_path,
        "truncated": {"train_sentences": datamodule.train.truncated,
                      "validation_sentences": datamodule.validation.truncated,
                      "validation_entities_dropped": datamodule.validation.entities_dropped},
    }
    (run_dir / RESULTS_JSON).write_text(json.dumps(result, indent=2) + "\n")
    return result


def export_best(result: dict, config: NerConfig, datamodule: NerDataModule, backbone: Backbone,
                directory: Path) -> nn.Module:
    """Writes the best run's model to `directory` with its tokenizer: NeoBERT in the hub layout, any other encoder
    as its `transformers` token classifier; both load with `AutoModelForTokenClassification` and name their tags
    in `config.json` (id2label). Returns the model."""
    task = datamodule.task
    model = load_best_weights(build_token_classifier(backbone, task, config.classifier_dropout), result["checkpoint"])
    if directory.exists():
        shutil.rmtree(directory)
    if isinstance(model, NeoBERTForTokenClassification):
        model.save_pretrained(directory, tokenizer=datamodule.tokenizer)
        hub_config = json.loads((directory / CONFIG_NAME).read_text())
        hub_config["id2label"] = {str(i): label for i, label in enumerate(task.labels)}
        hub_config["label2id"] = {label: i for i, label in enumerate(task.labels)}
        (directory / CONFIG_NAME).write_text(json.dumps(hub_config, indent=2) + "\n")
    else:
        model.save_pretrained(str(directory))
        datamodule.tokenizer.save_pretrained(str(directory))
    meta = {k: result[k] for k in ("task", "model", "run", "scores", "evaluated_on")} | {"labels": list(task.labels)}
    (directory / NER_RUN_INFO).write_text(json.dumps(meta, indent=2) + "\n")
    return model


def run_inputs(config: NerConfig) -> list[tuple[str, str | None]]:
    """What a run reads (its task directory must not hold any of it): the data, the model and its tokenizer."""
    return [(f"data.path={config.data.path!r}", config.data.path), (f"model={config.model!r}", config.model),
            (f"tokenizer={config.tokenizer!r}", config.tokenizer),
            *((f"data.files.{split}={path!r}", path) for split, path in config.data.files.items())]


def run_task(config: NerConfig, sweep: bool = False) -> dict:
    """Fine-tunes one task: a single run with the config's hyperparameters, or (sweep=True) the grid with its
    seeds, ranked by the median entity F1 over seeds. Keeps the best run's model in `<output_dir>/<task>/best/`."""
    task = get_ner_task(config.task)
    check_hub_sources(config, task)
    task_dir = output_root(config) / task.name
    prepare_task_dir(task_dir, config.overwrite, run_inputs(config))
    backbone = load_backbone(config.model, tokenizer=config.tokenizer)
    datamodule = NerDataModule(task, backbone.tokenizer, config.data, seed=config.trainer.seed)
    runs, best, _ = run_grid(
        config, sweep, task_dir, lambda run_config, run_dir: fine_tune(run_config, datamodule, backbone, run_dir),
        lambda result, run_config, directory: export_best(result, run_config, datamodule, backbone, directory))
    summary = summarize_runs(task.name, runs)
    summary.update(best_run=best["run"], evaluated_on=EVALUATED_ON, best_dir=str(task_dir / GLUE_BEST_DIR))
    write_summary(task_dir, summary, runs, sweep, "entity F1")
    return summary
