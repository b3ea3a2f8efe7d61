"""The evaluation of one step of the ablation ladder under its budget's protocol (docs/ablations.md): held-out MLM
loss and pseudo-perplexity, the zero-shot and fine-tuned STS probes, and a GLUE subset, each on the data this
machine has (the real files under ../shared/data, else offline stand-ins)."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path
from typing import Optional

from safetensors import safe_open

from neobert.config import ConfigError
from neobert.config.ablations import AblationBudgetConfig, GlueSubsetConfig, StsProbeConfig
from neobert.config.contrastive import ContrastiveConfig
from neobert.config.glue import GlueConfig
from neobert.data.backbone import load_backbone
from neobert.data.demo_corpus import write_demo_corpus, write_fallback_glue
from neobert.eval.heldout import heldout_mlm_loss, heldout_pseudo_perplexity
from neobert.eval.pseudo_perplexity import load_model_and_tokenizer
from neobert.jobs.ablation_ladder import StepResult
from neobert.jobs.contrastive import run_contrastive, sts_scores
from neobert.jobs.glue import run_task
from neobert.layout import (ABLATION_CORPORA_DIR, ABLATION_GLUE_DIR, ABLATION_GLUE_FALLBACK_DIR, ABLATION_STS_DIR,
                            EXPORT_DIR, STS_ZERO_SHOT_DIR, WEIGHTS_NAME)


def evaluation_protocol(budget: AblationBudgetConfig, heldout: str | None, sts_dir: str | None) -> dict:
    """The settings a row's scores depend on: a finished run is re-scored when they change."""
    return {"heldout": dataclasses.asdict(budget.heldout) if heldout else None,
            "sts": dataclasses.asdict(budget.sts) if sts_dir else None,
            "glue": dataclasses.asdict(budget.glue) if budget.glue.tasks else None}


def evaluate_step(result: StepResult, budget: AblationBudgetConfig, heldout: str | None, sts_dir: str | None,
                  glue_path: str | None, run_dir: Path, protocol: dict) -> None:
    """Fills the row's scores: held-out MLM loss and pseudo-perplexity, the STS probe, the GLUE subset."""
    export = Path(result.export_dir)
    if heldout is not None:
        model, tokenizer = load_model_and_tokenizer(str(export))
        settings = budget.heldout
        scores = heldout_mlm_loss(model, tokenizer, heldout, settings.documents, settings.max_length,
                                  settings.mask_rate, settings.batch_size)
        result.heldout_loss, result.heldout_accuracy = scores["loss"], scores["accuracy"]
        if settings.pseudo_perplexity_documents:
            result.pseudo_perplexity = heldout_pseudo_perplexity(
                model, tokenizer, heldout, settings.pseudo_perplexity_documents,
                settings.pseudo_perplexity_max_length)["pseudo_perplexity"]
    if sts_dir is not None:
        result.sts_zero_shot, result.sts_tuned = sts_probe(export, budget.sts, sts_dir, run_dir / ABLATION_STS_DIR,
                                                           result.seed)
    if glue_path is not None:
        result.glue = evaluate_glue(export, budget.glue, glue_path, run_dir / ABLATION_GLUE_DIR)
        result.glue_score = sum(result.glue.values()) / len(result.glue)
    result.protocol = protocol


def sts_probe(export_dir: Path, sts: StsProbeConfig, data_dir: str, output_dir: Path,
              seed: int) -> tuple[float, Optional[float]]:
    """(zero-shot, tuned) STS Benchmark dev Spearman of the checkpoint's mean-pooled embeddings; tuned is None
    without fine-tuning steps. The fine-tune is the contrastive job (InfoNCE, in-batch negatives) on the train
    pairs scored >= 4, in fp32, from a fresh output directory."""
    config = ContrastiveConfig(model=str(export_dir), eval_sts=str(Path(data_dir) / STS_DEV), output_dir=str(output_dir))
    config.data.datasets = ["STSBenchmark"]
    config.data.local_files = {"STSBenchmark": str(Path(data_dir) / STS_TRAIN)}
    config.data.batch_size, config.data.max_length, config.data.seed = sts.batch_size, sts.max_length, seed
    config.optimizer.lr = sts.lr
    config.scheduler.warmup_steps = min(sts.warmup_steps, max(0, sts.finetune_steps - 1))
    config.trainer.max_steps = max(1, sts.finetune_steps)
    config.trainer.seed, config.trainer.precision, config.trainer.accelerator = seed, "32-true", "cpu"
    config.trainer.checkpoint_every_n_steps = 0
    config.logging.progress_bar = False
    if not sts.finetune_steps:
        backbone = load_backbone(config.model)
        return sts_scores(config, backbone, output_dir / STS_ZERO_SHOT_DIR)["full"], None
    shutil.rmtree(output_dir, ignore_errors=True)  # an interrupted fine-tune starts again: it takes seconds
    summary = run_contrastive(config)
    shutil.rmtree(output_dir / EXPORT_DIR, ignore_errors=True)  # the scores are what the ladder keeps
    return summary["sts_zero_shot"], summary["sts_tuned"]


STS_TRAIN, STS_DEV = "sts-train.csv", "sts-dev.csv"


def _shared_data() -> Path:
    """$NEOBERT_SHARED_DATA (unset: ../shared/data from the working directory)."""
    shared = os.environ.get("NEOBERT_SHARED_DATA")
    return Path(shared) if shared else Path.cwd().parent / "shared" / "data"


def sts_data_dir(sts: StsProbeConfig) -> tuple[str | None, str]:
    if sts.data_dir is None:
        return None, ""
    directory = _shared_data() / "stsbenchmark" if sts.data_dir == "auto" else Path(sts.data_dir)
    if (directory / STS_TRAIN).is_file() and (directory / STS_DEV).is_file():
        return str(directory), ""
    if sts.data_dir == "auto":
        return None, (f"STS probe: no STS Benchmark files in {directory} (set sts.data_dir to a folder with "
                      f"{STS_TRAIN} and {STS_DEV}): not scored")
    raise ConfigError(f"sts.data_dir={sts.data_dir!r}: needs {STS_TRAIN} and {STS_DEV} in it")


def shared_glue_dir() -> Path | None:
    """$NEOBERT_SHARED_DATA/glue (unset: ../shared/data/glue from the working directory) when it holds RTE."""
    root = _shared_data() / "glue"
    return root if (root / "rte").is_dir() else None


def glue_data_path(glue: GlueSubsetConfig, output_dir: Path) -> tuple[str | None, str]:
    if glue.data_path != "auto":
        return glue.data_path, ""
    shared = shared_glue_dir()
    if shared is not None:
        steps = f"{glue.max_train_steps} steps" if glue.max_train_steps else "full"
        return str(shared), (f"GLUE: local files {shared} ({steps} fine-tuning on "
                             f"{glue.max_train_examples or 'all'} training examples)")
    corpus = write_demo_corpus(output_dir / ABLATION_CORPORA_DIR / "demo.jsonl")
    fallback = write_fallback_glue(corpus, output_dir / ABLATION_GLUE_FALLBACK_DIR)
    return str(fallback), (f"GLUE: no GLUE files here; scored on the built-in fallback pair task built from the "
                           f"demo corpus ({fallback}/rte), not on RTE")


def evaluate_glue(export_dir: str | Path, glue: GlueSubsetConfig, data_path: str | None, output_dir: Path) -> dict:
    """Main score (a fraction) per task of the subset, from a short fine-tune of the checkpoint."""
    scores = {}
    for task in glue.tasks:
        # overwrite: the ladder owns this directory, and re-scores a finished step when its protocol changes
        config = GlueConfig(task=task, model=str(export_dir), output_dir=str(output_dir), overwrite=True)
        config.data.path = data_path
        config.data.batch_size = glue.batch_size
        config.data.max_length = glue.max_length
        config.data.max_train_examples = glue.max_train_examples
        config.data.max_eval_examples = glue.max_eval_examples
        config.optimizer.lr = glue.lr
        config.trainer.seed = glue.seed
        config.logging.progress_bar = False
        if glue.max_train_steps:
            config.trainer.max_steps = glue.max_train_steps
            config.trainer.eval_every_n_steps = max(1, glue.max_train_steps // 3)
        summary = run_task(config)
        scores[task] = float(summary["scores"]["score"])
    return scores


def count_parameters(export: Path) -> int | None:
    path = export / WEIGHTS_NAME
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


