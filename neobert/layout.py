"""The names of every file and folder this suite writes or reads, in one place.

A model directory (the hub layout, also what `transformers` and `sentence-transformers` read) holds
`config.json` + `model.safetensors` (+ the tokenizer's files). A run directory (`output_dir` of any job) holds
`checkpoints/` (Lightning checkpoints, `last.ckpt` the newest), `logs/version_N/metrics.csv` (CSV logger),
`tensorboard/version_N/` and `export/` (the trained model in the hub layout).
"""

from __future__ import annotations

from pathlib import Path

# A model directory (hub layout).
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer_config.json", "vocab.txt", "tokenizer.json")

# A run directory.
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
LOGS_DIR = "logs"
TENSORBOARD_DIR = "tensorboard"
EXPORT_DIR = "export"
METRICS_CSV = "metrics.csv"
RUN_CONFIG = "config.yaml"
RESULTS_JSON = "results.json"


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a model directory carries its own tokenizer files."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def last_checkpoint(output_dir: str | Path) -> Path | None:
    path = checkpoint_dir(output_dir) / LAST_CHECKPOINT
    return path if path.exists() else None


def metrics_csvs(output_dir: str | Path) -> list[Path]:
    """The CSV logs of a run, oldest version first (a resumed run adds a version)."""
    return sorted((Path(output_dir) / LOGS_DIR).glob(f"version_*/{METRICS_CSV}"),
                  key=lambda p: int(p.parent.name.removeprefix("version_")))
