"""What every fine-tuning job (GLUE, NER) shares: the task runner (`run_task`), the paper's grid with seeds
(`--sweep`), one run with its best checkpoint kept, the best run's export, and the summaries (median over seeds per
grid point).

A job describes itself in a `FineTuneJob`: its config schema and task table, its data module, its hub and input
checks, `fine_tune(run_config, datamodule, backbone, run_dir) -> result` (a result record holding at least
`scores` with `score`, `checkpoint`, `batch_size`, `lr`, `weight_decay`, `seed`, `run`, `model`) and
`export_best(result, run_config, datamodule, backbone, directory) -> model`; `run_task` does the rest.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch import nn

from neobert.config import ConfigError, load_config, to_yaml
from neobert.data.backbone import Backbone, load_backbone
from neobert.layout import (GLUE_BEST_CHECKPOINT, GLUE_BEST_DIR, GLUE_SWEEP_JSON, GLUE_SWEEP_MD, RESULTS_JSON,
                            RUN_CONFIG, checkpoint_dir)
from neobert.lit.trainer import build_trainer
from neobert.model.checkpoint import submodule_state
from neobert.outputs import FINETUNE_TASK, claim_output_dir, clear_output_dir, hold_output_dir


def run_name(batch_size: int, lr: float, weight_decay: float, seed: int) -> str:
    return f"bs{batch_size}_lr{lr:g}_wd{weight_decay:g}_seed{seed}"


FINISHED_RUN = ("invalid config key 'overwrite': {directory} already holds a finished run ({held}): set "
                "overwrite=true to replace it, or choose another output_dir")
TASK_DIR = "invalid config key 'output_dir': the task directory {}"  # what a refusal of a task directory names


def prepare_task_dir(task_dir: Path, overwrite: bool, inputs: Sequence[tuple[str, str | Path | None]] = ()) -> None:
    """A task directory holding a finished run (results.json, best/) is refused unless `overwrite`, which removes
    what the suite wrote there first (results, best/, the runs; never anything else): a new result is never mixed
    with an earlier one's files. A task directory holding one of the run's `inputs` (its data, the model it starts
    from) is refused whatever `overwrite` says (`neobert.outputs.claim_output_dir`)."""
    claim_output_dir(task_dir, FINETUNE_TASK, where=TASK_DIR.format(task_dir), noun="output_dir", overwrite=True,
                     flag="overwrite=true", inputs=inputs)
    finished = [name for name in (RESULTS_JSON, GLUE_BEST_DIR) if (task_dir / name).exists()]
    if finished and not overwrite:
        raise ConfigError(FINISHED_RUN.format(directory=task_dir, held=", ".join(finished)))
    if finished:
        clear_output_dir(task_dir, FINETUNE_TASK)


def grid_configs(config, sweep: bool) -> list:
    """One config per run: the grid of `config.sweep` (batch size x lr x weight decay) x its seeds, or (no sweep)
    the config's own point and seed."""
    if sweep:
        grid = list(itertools.product(config.sweep.batch_sizes, config.sweep.lrs, config.sweep.weight_decays))
        seeds = config.sweep.seeds
    else:
        grid = [(config.data.batch_size, config.optimizer.lr, config.optimizer.weight_decay)]
        seeds = [config.trainer.seed]
    runs = []
    for (batch_size, lr, weight_decay), seed in itertools.product(grid, seeds):
        run_config = copy.deepcopy(config)
        run_config.data.batch_size, run_config.optimizer.lr = batch_size, lr
        run_config.optimizer.weight_decay, run_config.trainer.seed = weight_decay, seed
        runs.append(run_config)
    return runs


def config_run_name(config) -> str:
    return run_name(config.data.batch_size, config.optimizer.lr, config.optimizer.weight_decay, config.trainer.seed)


def fit_keeping_best(config, module: L.LightningModule, datamodule, run_dir: Path):
    """Fits `module` with validation every `trainer.eval_every_n_steps` (at least once, even in a run shorter than
    the interval), early stopping on `val/score`, and the best weights kept in `run_dir/checkpoints/best.ckpt`.
    Returns (trainer, the checkpoint callback, training seconds)."""
    steps_per_epoch = -(-datamodule.steps_per_epoch() // config.trainer.accumulate_grad_batches)
    total_steps = steps_per_epoch * config.trainer.max_epochs
    if config.trainer.max_steps > 0:
        total_steps = min(total_steps, config.trainer.max_steps)
    eval_every = max(1, min(config.trainer.eval_every_n_steps, total_steps))
    checkpoint = ModelCheckpoint(dirpath=checkpoint_dir(run_dir), filename=GLUE_BEST_CHECKPOINT, monitor="val/score",
                                 mode="max", save_top_k=1, save_weights_only=True, auto_insert_metric_name=False)
    callbacks: list[L.Callback] = [checkpoint]
    if config.logging.loggers:  # the monitor needs a logger
        callbacks.append(LearningRateMonitor("step"))
    if config.trainer.early_stopping_patience > 0:
        callbacks.append(EarlyStopping(monitor="val/score", mode="max",
                                       patience=config.trainer.early_stopping_patience))
    trainer = build_trainer(dataclasses.replace(config.trainer, eval_every_n_steps=eval_every), config.logging,
                            run_dir, callbacks=callbacks)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_CONFIG).write_text(to_yaml(config))
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    seconds = time.perf_counter() - start
    if not module.best_scores:
        raise RuntimeError(f"{run_dir}: no validation ran (eval_every_n_steps={eval_every})")
    return trainer, checkpoint, seconds


def load_best_weights(model: nn.Module, checkpoint_path: str | Path) -> nn.Module:
    """The weights of a run's best Lightning checkpoint (saved from a module holding `model` as `.model`)."""
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=True)["state_dict"]
    model.load_state_dict(submodule_state(state))
    return model


def run_grid(config, sweep: bool, task_dir: Path, fine_tune: Callable[[object, Path], dict],
             export: Callable[[dict, object, Path], nn.Module]) -> tuple[list[dict], dict, nn.Module]:
    """Every run of `grid_configs` under `task_dir/<run name>/`; the best run so far (by `scores.score`) is
    exported to `task_dir/best/` as soon as it is found; per-run checkpoints are deleted unless
    `keep_run_checkpoints`. Returns (every run's result, the best one, the best exported model)."""
    runs, best, best_model = [], None, None
    for run_config in grid_configs(config, sweep):
        result = fine_tune(run_config, task_dir / config_run_name(run_config))
        runs.append(result)
        if best is None or result["scores"]["score"] > best["scores"]["score"]:
            best = result
            best_model = export(result, run_config, task_dir / GLUE_BEST_DIR)
        if not config.keep_run_checkpoints:
            shutil.rmtree(Path(result["checkpoint"]).parent, ignore_errors=True)
    return runs, best, best_model


def summarize_runs(task: str, runs: list[dict]) -> dict:
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
    return {"task": task, "model": runs[0]["model"], "scores": table[0]["median"],
            "hyperparameters": {k: table[0][k] for k in ("batch_size", "lr", "weight_decay")},
            "grid": table, "train_seconds": sum(r["train_seconds"] for r in runs)}


def sweep_markdown(task: str, score_name: str, summary: dict) -> str:
    lines = [f"# {task}: grid ranked by the median {score_name} over seeds", "",
             "| batch | lr | weight decay | median | per seed |", "|---|---|---|---|---|"]
    for row in summary["grid"]:
        per_seed = ", ".join(f"{100 * s:.1f}" for s in row["per_seed"])
        lines.append(f"| {row['batch_size']} | {row['lr']:g} | {row['weight_decay']:g} | "
                     f"{100 * row['median']['score']:.1f} | {per_seed} |")
    return "\n".join(lines) + "\n"


def write_summary(task_dir: Path, summary: dict, runs: list[dict], sweep: bool, score_name: str) -> None:
    """`task_dir/results.json`, and for a sweep `sweep.json` (every run) and `sweep.md` (the ranked grid)."""
    (task_dir / RESULTS_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    if sweep:
        (task_dir / GLUE_SWEEP_JSON).write_text(json.dumps(runs, indent=2) + "\n")
        (task_dir / GLUE_SWEEP_MD).write_text(sweep_markdown(summary["task"], score_name, summary))


@dataclass(frozen=True)
class FineTuneJob:
    """What one fine-tuning job (GLUE, NER) brings to `run_task`. Callables taking `(config, task)` get the job's
    config and its task table's entry (`GlueTask`, `NerTask`)."""

    name: str  # the packaged configs `<name>/<task>` and the default output root `runs/<name>`
    config_class: type
    get_task: Callable[[str], Any]
    datamodule: Callable[..., L.LightningDataModule]  # (task, tokenizer, data config, seed=...)
    check_hub_sources: Callable[[Any, Any], None]  # before any work: names each key an unreachable hub would fail
    run_inputs: Callable[[Any, Any], list[tuple[str, str | Path | None]]]  # what the task directory may not hold
    fine_tune: Callable[[Any, L.LightningDataModule, Backbone, Path], dict]  # one seeded run -> its result record
    export_best: Callable[[dict, Any, L.LightningDataModule, Backbone, Path], nn.Module]
    score_name: Callable[[Any], str]  # (task) -> the score sweep.md ranks by
    summary_fields: Callable[[Path], dict] = lambda task_dir: {}  # (task directory) -> the job's own summary keys
    # (config, TaskRun) -> what the job writes into the task directory after the summary (GLUE's test predictions)
    finish: Callable[[Any, TaskRun], None] = lambda config, run: None

    def load_task_config(self, task: str, config: str | Path | None = None, model: str | None = None,
                         overrides: Sequence[str] = ()):
        """The config of one task: `config` (a path or packaged name; default the packaged `<name>/<task>`), then
        the `key=value` overrides, then `task` and `model` (when given)."""
        extra = [f"task={task}"] + ([f"model={model}"] if model else [])
        return load_config(self.config_class, config or f"{self.name}/{task}", [*overrides, *extra])

    def output_root(self, config) -> Path:
        """`output_dir`, or `runs/<name>/<model>` (the model's name made a folder name)."""
        if config.output_dir:
            return Path(config.output_dir)
        return Path("runs") / self.name / config.model.strip("/").replace("/", "--").replace(":", "-")


class TaskRun(NamedTuple):
    """A finished task: its summary, its directory, and what a job may still use (GLUE's test predictions)."""

    summary: dict
    task_dir: Path
    datamodule: L.LightningDataModule
    best_model: nn.Module


def run_task(job: FineTuneJob, config, sweep: bool = False) -> TaskRun:
    """Fine-tunes one task: a single run with the config's hyperparameters, or (sweep=True) the grid with several
    seeds, ranked by the median over seeds. Keeps the best run's model in `<output_dir>/<task>/best/` and writes
    each run's `results.json`, the task's summary (`write_summary`) and what the job adds (`job.finish`). The task
    directory is held throughout (neobert.outputs.hold_output_dir): a second run into it is refused before it
    writes or removes anything."""
    task = job.get_task(config.task)
    job.check_hub_sources(config, task)
    task_dir = job.output_root(config) / task.name
    with hold_output_dir(task_dir, where=TASK_DIR.format(task_dir)):
        run = run_held_task(job, config, task, task_dir, sweep)
        job.finish(config, run)
    return run


def run_held_task(job: FineTuneJob, config, task, task_dir: Path, sweep: bool) -> TaskRun:
    """`run_task` once its task directory is held."""
    prepare_task_dir(task_dir, config.overwrite, job.run_inputs(config, task))
    backbone = load_backbone(config.model, tokenizer=config.tokenizer, **config.model_overrides)
    datamodule = job.datamodule(task, backbone.tokenizer, config.data, seed=config.trainer.seed)

    def fine_tune(run_config, run_dir: Path) -> dict:
        # Seeded before the job builds its head. The data is read once per task; a run changes its batches only.
        L.seed_everything(run_config.trainer.seed, workers=True, verbose=False)
        datamodule.batch_size, datamodule.seed = run_config.data.batch_size, run_config.trainer.seed
        datamodule.setup("fit")
        result = job.fine_tune(run_config, datamodule, backbone, run_dir)
        (run_dir / RESULTS_JSON).write_text(json.dumps(result, indent=2) + "\n")
        return result

    runs, best, best_model = run_grid(
        config, sweep, task_dir, fine_tune,
        lambda result, run_config, directory: job.export_best(result, run_config, datamodule, backbone, directory))
    summary = summarize_runs(task.name, runs)
    summary["best_run"] = best["run"]
    summary.update(job.summary_fields(task_dir))
    write_summary(task_dir, summary, runs, sweep, job.score_name(task))
    return TaskRun(summary, task_dir, datamodule, best_model)
