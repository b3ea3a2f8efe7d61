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

from torch import nn

from neobert.config.ner import NerConfig
from neobert.data.backbone import Backbone, model_needs_hub
from neobert.data.ner import NER_TASKS, NerTask, get_ner_task, uses_hub  # noqa: F401 - NER_TASKS: experiments.ner
from neobert.data.ner_datamodule import NerDataModule
from neobert.hub import HubUnreachableError, hub_reachable
from neobert.jobs import finetune
from neobert.jobs.finetune import FineTuneJob, fit_keeping_best, load_best_weights
from neobert.layout import CONFIG_NAME, GLUE_BEST_DIR, NER_RUN_INFO
from neobert.lit.ner import NerTagger, build_token_classifier
from neobert.model.modeling import NeoBERTForTokenClassification

EVALUATED_ON = "validation"  # the dev split: model selection and the reported scores (no test split locally)


def run_ner(task: str, config: str | Path | None = None, model: str | None = None, overrides: Sequence[str] = (),
            sweep: bool = False) -> dict:
    """What `python -m experiments.ner` runs."""
    return run_task(load_task_config(task, config, model, overrides), sweep=sweep)


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
    """One run (seeded, its data set up, by `finetune.run_task`): a fresh head on the pretrained weights,
    validation every n steps, early stopping, the best weights kept in `run_dir/checkpoints/best.ckpt`. Returns the
    run's result record."""
    task = datamodule.task
    model = build_token_classifier(backbone, task, config.classifier_dropout)
    module = NerTagger(task, model, config.optimizer, config.scheduler, datamodule.validation)
    trainer, checkpoint, seconds = fit_keeping_best(config, module, datamodule, run_dir)
    return {
        "task": task.name, "model": config.model, "run": run_dir.name, "batch_size": config.data.batch_size,
        "lr": config.optimizer.lr, "weight_decay": config.optimizer.weight_decay, "seed": config.trainer.seed,
        "evaluated_on": EVALUATED_ON, "best_step": module.best_step, "steps": trainer.global_step,
        "train_seconds": seconds, "scores": module.best_scores, "checkpoint": checkpoint.best_model_path,
        "truncated": {"train_sentences": datamodule.train.truncated,
                      "validation_sentences": datamodule.validation.truncated,
                      "validation_entities_dropped": datamodule.validation.entities_dropped},
    }


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


def run_inputs(config: NerConfig, task: NerTask) -> list[tuple[str, str | None]]:
    """What a run reads (its task directory must not hold any of it): the data, the model and its tokenizer (the
    same for every task: `task` is the FineTuneJob signature's)."""
    return [(f"data.path={config.data.path!r}", config.data.path), (f"model={config.model!r}", config.model),
            (f"tokenizer={config.tokenizer!r}", config.tokenizer),
            *((f"data.files.{split}={path!r}", path) for split, path in config.data.files.items())]


def summary_fields(task_dir: Path) -> dict:
    """What the task's results.json adds to the shared summary: the split scored and where the best model is."""
    return {"evaluated_on": EVALUATED_ON, "best_dir": str(task_dir / GLUE_BEST_DIR)}


NER = FineTuneJob(name="ner", config_class=NerConfig, get_task=get_ner_task, datamodule=NerDataModule,
                  check_hub_sources=check_hub_sources, run_inputs=run_inputs,
                  fine_tune=fine_tune, export_best=export_best, score_name=lambda task: "entity F1",
                  summary_fields=summary_fields)
load_task_config = NER.load_task_config


def run_task(config: NerConfig, sweep: bool = False) -> dict:
    """One task fine-tuned (`finetune.run_task`): one run, or with `sweep` the grid and its seeds ranked by median
    entity F1; the best run's model in `<output_dir>/<task>/best/`."""
    return finetune.run_task(NER, config, sweep).summary
