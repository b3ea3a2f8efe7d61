"""The names of every file and folder this suite writes or reads, in one place.

A model directory (the hub layout, also what `transformers` and `sentence-transformers` read) holds
`config.json` + `model.safetensors` (+ the tokenizer's files). A run directory (`output_dir` of any job) holds
`checkpoints/` (Lightning checkpoints, `last.ckpt` the newest), `logs/version_N/metrics.csv` (CSV logger),
`tensorboard/version_N/` and `export/` (the trained model in the hub layout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

# A model directory (hub layout).
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer_config.json", "vocab.txt", "tokenizer.json")
SENTENCE_BERT_CONFIG = "sentence_bert_config.json"  # a sentence-transformers directory: its max_seq_length

# A run directory.
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
LOGS_DIR = "logs"
TENSORBOARD_DIR = "tensorboard"
EXPORT_DIR = "export"
METRICS_CSV = "metrics.csv"
RUN_CONFIG = "config.yaml"
RESULTS_JSON = "results.json"
# In an output_dir while a run writes it: who holds it (pid, host, command, start), under an OS lock that ends with
# that process (neobert.outputs.hold_output_dir)
RUN_LOCK = ".run.lock"


# What each job writes under its output_dir, besides the run-directory names above.
LOSS_PLOT = "loss.png"  # pretraining
PHASE_PLAN = "phases.json"  # a phased pretraining run: the plan it holds, every phase resolved (jobs/phases.py)
PROFILE_NAME = "profile"  # trainer.profiler's report: profile.txt (Lightning adds the stage and rank to the name)
AVERAGING_JSON = "averaging.json"  # in an export averaged over checkpoints: which ones (experiments.export)
EMA_EXPORT_DIR = "ema"  # export/ema/: the EMA of the weights (trainer.ema), beside the trained weights in export/
GLUE_BEST_DIR = "best"  # <task>/best/: the best run's model, the start point of `transfer_from`
GLUE_BEST_CHECKPOINT = "best"  # a run's best Lightning checkpoint: <run>/checkpoints/best.ckpt
GLUE_RUN_INFO = "glue_run.json"  # in best/: which run it is and its scores
GLUE_PREDICTIONS_DIR = "predictions"
GLUE_SWEEP_JSON, GLUE_SWEEP_MD = "sweep.json", "sweep.md"
GLUE_TABLE_JSON, GLUE_TABLE_MD = "glue_results.json", "glue_results.md"  # `--task all`
NER_RUN_INFO = "ner_run.json"  # NER: in <task>/best/ (beside GLUE's best/ layout): the run, its scores, the tags
STS_ZERO_SHOT_DIR, STS_TUNED_DIR = "sts_zero_shot", "sts_tuned"  # contrastive: the local STS before and after
MATRYOSHKA_JSON = "matryoshka.json"  # in a contrastive export: the embedding sizes it was trained for
MTEB_SUMMARY_JSON, MTEB_SUMMARY_MD = "summary.json", "summary.md"
BEIR_CORPUS, BEIR_QUERIES, BEIR_QRELS_DIR = "corpus.jsonl", "queries.jsonl", "qrels"  # a BEIR directory (read)
LONG_CONTEXT_JSON, LONG_CONTEXT_MD, LONG_CONTEXT_PLOT = "long_context.json", "long_context.md", "long_context.png"
LONG_CONTEXT_DATA_DIR = "data"  # experiments.long_context: the generated tasks, <task>.jsonl per task
THROUGHPUT_CSV, THROUGHPUT_MD, THROUGHPUT_PLOT = "throughput.csv", "throughput.md", "throughput.png"
# experiments.throughput profile=true: each timed row's step, its self time per category and per kernel/op name
THROUGHPUT_PROFILE_CSV, THROUGHPUT_PROFILE_NAMES_CSV = "throughput_profile.csv", "throughput_profile_names.csv"
# ... and the Chrome trace of each profiled row's step, <mode>_<layout>_<length>_<model>.json.gz in this folder
THROUGHPUT_TRACES_DIR = "throughput_traces"
# experiments.gpu_check: the report, and the run directories of its training loops inside its output_dir
GPU_CHECK_MD, GPU_CHECK_JSON = "gpu_check.md", "gpu_check.json"
# profile=true: the Chrome trace of the profiled step, its self time per category and per kernel/op name
GPU_CHECK_TRACE, GPU_CHECK_PROFILE_CSV, GPU_CHECK_PROFILE_NAMES_CSV = ("gpu_check_trace.json", "gpu_check_profile.csv",
                                                                     "gpu_check_profile_names.csv")
# ... and of the recipe's loop over profile_steps optimizer steps after its warm-up
GPU_CHECK_LOOP_TRACE, GPU_CHECK_LOOP_PROFILE_CSV, GPU_CHECK_LOOP_PROFILE_NAMES_CSV = (
    "gpu_check_loop_trace.json", "gpu_check_loop_profile.csv", "gpu_check_loop_profile_names.csv")
GPU_CHECK_RECIPE_RUN, GPU_CHECK_PLAIN_RUN = "recipe", "plain"
PPPL_DOCUMENTS_CSV, PPPL_BUCKETS_JSON = "documents.csv", "buckets.json"
PPPL_MD, PPPL_PLOT = "pseudo_perplexity.md", "pseudo_perplexity.png"
# The ablation ladder: corpora/<name>.jsonl (demo, offline), corpora/heldout.jsonl (the documents every step is
# scored on) and corpora/<name>.train.jsonl (the rest of the corpus they come from); <step>/seed<k>/ per run.
ABLATION_CORPORA_DIR, ABLATION_HELDOUT = "corpora", "heldout.jsonl"
ABLATION_RESULTS_MD, ABLATION_RUN_ROW = "results.md", "ladder_row.json"
ABLATION_TOKENIZERS_DIR, ABLATION_GLUE_DIR, ABLATION_GLUE_FALLBACK_DIR = "tokenizers", "glue", "glue_fallback"
ABLATION_STS_DIR = "sts"


def ablation_figure(metric: str) -> str:
    """Figure 1 of the ladder for one metric (mean and sd over seeds per step)."""
    return f"figure1_{metric}.png"


COMPARISON_MD = "comparison.md"  # experiments.compare_runs


def comparison_plot(metric: str) -> str:
    """experiments.compare_runs: one metric of every run (e.g. train/loss -> train_loss.png)."""
    return metric.replace("/", "_") + ".png"


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a model directory carries its own tokenizer files."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR



def metrics_csvs(output_dir: str | Path) -> list[Path]:
    """The CSV logs of a run, oldest version first (a resumed run adds a version)."""
    return sorted((Path(output_dir) / LOGS_DIR).glob(f"version_*/{METRICS_CSV}"),
                  key=lambda p: int(p.parent.name.removeprefix("version_")))


def write_atomically(path: str | Path, lines: Iterable[str]) -> Path:
    """Writes `lines` to a temporary file beside `path` and renames it over `path`: an interrupted or failed write
    leaves no partial file under the real name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as file:
            file.writelines(lines)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
