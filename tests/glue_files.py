"""Small GLUE files in both local layouts (hub parquet splits, original GLUE TSVs), written by the tests, so the
loaders are exercised on every machine (the real files under ../shared/data/glue are optional)."""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd

from neobert.data.glue import GLUE_TASKS

WORDS = ("the cat sat on a mat while dogs ran past quickly and birds sang over green hills near old town "
         "river bridge under bright morning sun").split()
NLI_NAMES = {"mnli": ["entailment", "neutral", "contradiction"], "qnli": ["entailment", "not_entailment"],
             "rte": ["entailment", "not_entailment"]}


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))).capitalize() + "."


def rows(task_name: str, n: int, seed: int, labelled: bool = True) -> pd.DataFrame:
    task = GLUE_TASKS[task_name]
    rng = random.Random(seed)
    data = {c: [sentence(rng) for _ in range(n)] for c in task.text_columns}
    if not labelled:
        data["label"] = [-1] * n
    elif task.is_regression:
        data["label"] = [round(rng.uniform(0, 5), 3) for _ in range(n)]
    else:
        data["label"] = [i % task.num_labels for i in range(n)]
    data["idx"] = list(range(n))
    return pd.DataFrame(data)


def split_sizes(task_name: str, n_train: int, n_eval: int) -> dict[str, tuple[int, bool]]:
    task = GLUE_TASKS[task_name]
    sizes = {"train": (n_train, True)}
    sizes.update({s: (n_eval, True) for s in task.validation_splits})
    sizes.update({s: (n_eval, False) for s in task.test_splits})
    return sizes


def write_parquet_task(root: Path, task_name: str, n_train: int = 48, n_eval: int = 16,
                       hub_names: bool = False) -> dict[str, pd.DataFrame]:
    """`root/<task>/<split>.parquet`, or the hub's own `<split>-00000-of-00001.parquet` names."""
    directory = root / task_name
    directory.mkdir(parents=True, exist_ok=True)
    frames = {}
    for i, (split, (n, labelled)) in enumerate(split_sizes(task_name, n_train, n_eval).items()):
        frames[split] = rows(task_name, n, seed=i, labelled=labelled)
        name = f"{split}-00000-of-00001.parquet" if hub_names else f"{split}.parquet"
        frames[split].to_parquet(directory / name)
    return frames


def write_tsv_task(root: Path, task_name: str, frames: dict[str, pd.DataFrame], folder: str | None = None) -> Path:
    """The same rows in the original GLUE TSV layout (`train.tsv`, `dev.tsv`, `dev_matched.tsv`, ...)."""
    task = GLUE_TASKS[task_name]
    directory = root / (folder or task_name)
    directory.mkdir(parents=True, exist_ok=True)
    for split, frame in frames.items():
        test = split.startswith("test")
        columns = {hub: task.tsv_columns.get(hub, hub) for hub in task.text_columns}
        lines = []
        headerless = task.tsv_headerless_fields is not None and not test
        for _, row in frame.iterrows():
            if task.tsv_label_map is not None:
                label = NLI_NAMES[task_name][int(row["label"])] if not test else None
            else:
                label = f"{row['label']:.3f}" if task.is_regression else str(int(row["label"]))
            if headerless:  # CoLA: source, label, original label, sentence
                lines.append(f"src\t{label}\t\t{row['sentence']}")
                continue
            record = {"index": str(row["idx"]), **{tsv: row[hub] for hub, tsv in columns.items()}}
            if not test:
                record[task.tsv_label_column] = label
            lines.append(record)
        if headerless:
            text = "\n".join(lines) + "\n"
        else:
            header = list(lines[0].keys())
            text = "\n".join(["\t".join(header)] + ["\t".join(r[h] for h in header) for r in lines]) + "\n"
        (directory / (split.replace("validation", "dev") + ".tsv")).write_text(text, encoding="utf-8")
    return directory


def set_tsv_label(directory: Path, line: int, label: str, split: str = "train") -> list[str]:
    """Rewrites `split`.tsv of a task written by `write_tsv_task` with the label of line `line` (0-based, the header
    is line 0) set to `label`; returns its lines as written."""
    path = directory / f"{split}.tsv"
    lines = path.read_text().splitlines()
    lines[line] = lines[line].rsplit("\t", 1)[0] + f"\t{label}"
    path.write_text("\n".join(lines) + "\n")
    return lines
