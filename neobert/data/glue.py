"""GLUE: the task table, loading (hub or local files), tokenization and label checks (the DataModule that serves
them is `neobert.data.glue_datamodule.GlueDataModule`, on the layout and batching of `neobert.data.finetune`,
length-grouped batches included).

Every source yields the same thing, a `datasets.Dataset` with the hub's `nyu-mll/glue` columns (text columns,
`label`, `idx`), so everything after loading is one code path:
* `path=None`: the hub's `nyu-mll/glue` (needs the hub; fails fast offline, naming `data.path`);
* `path=<dir>`: local files, either the hub's parquet split layout (`<dir>/<task>/train.parquet`, or the hub's
  own `train-00000-of-00001.parquet` names) or the original GLUE TSV layout (`<dir>/<task>/train.tsv`,
  `dev.tsv`, `dev_matched.tsv`, ...; task folders named `rte` or `RTE`, `stsb` or `STS-B`, ...).
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from neobert.errors import ConfigError, DataError
from neobert.hub import HubUnreachableError, require_hub

log = logging.getLogger(__name__)

HUB_DATASET = "nyu-mll/glue"
TEST_LABEL = -1  # the hub's label for the unlabelled test splits


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its hub columns and splits, its metrics, and how its original TSV files map onto them."""

    name: str
    text_columns: tuple[str, ...]  # hub column names, one or two
    num_labels: int  # 1 = regression (STS-B)
    metrics: tuple[str, ...]  # as GLUE defines them; names from neobert.eval.glue_metrics
    main_metric: str  # the score used to pick the best checkpoint and shown in the Table 3 layout
    validation_splits: tuple[str, ...] = ("validation",)
    test_splits: tuple[str, ...] = ("test",)
    folder_names: tuple[str, ...] = ()  # original GLUE folder names besides the hub's task name
    # Original TSV layout: hub column -> TSV column, the TSV label column, how its values map to hub labels.
    tsv_columns: dict[str, str] = field(default_factory=dict)
    tsv_label_column: str = "label"
    tsv_label_map: Optional[dict[str, int]] = None  # None: the TSV label is already the number
    tsv_headerless_fields: Optional[tuple[str, ...]] = None  # CoLA's train/dev files have no header row

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", *self.validation_splits, *self.test_splits)


_NLI3 = {"entailment": 0, "neutral": 1, "contradiction": 2}
_NLI2 = {"entailment": 0, "not_entailment": 1}

GLUE_TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask("cola", ("sentence",), 2, ("matthews_correlation",), "matthews_correlation",
                 folder_names=("CoLA",), tsv_headerless_fields=("source", "label", "original_label", "sentence")),
        GlueTask("sst2", ("sentence",), 2, ("accuracy",), "accuracy", folder_names=("SST-2",)),
        GlueTask("mrpc", ("sentence1", "sentence2"), 2, ("f1", "accuracy"), "f1", folder_names=("MRPC",),
                 tsv_columns={"sentence1": "#1 String", "sentence2": "#2 String"}, tsv_label_column="Quality"),
        GlueTask("qqp", ("question1", "question2"), 2, ("f1", "accuracy"), "accuracy", folder_names=("QQP",),
                 tsv_label_column="is_duplicate"),
        GlueTask("stsb", ("sentence1", "sentence2"), 1, ("pearson", "spearman"), "pearson",
                 folder_names=("STS-B",), tsv_label_column="score"),
        GlueTask("mnli", ("premise", "hypothesis"), 3, ("accuracy",), "accuracy",
                 validation_splits=("validation_matched", "validation_mismatched"),
                 test_splits=("test_matched", "test_mismatched"), folder_names=("MNLI",),
                 tsv_columns={"premise": "sentence1", "hypothesis": "sentence2"}, tsv_label_column="gold_label",
                 tsv_label_map=_NLI3),
        GlueTask("qnli", ("question", "sentence"), 2, ("accuracy",), "accuracy", folder_names=("QNLI",),
                 tsv_label_map=_NLI2),
        GlueTask("rte", ("sentence1", "sentence2"), 2, ("accuracy",), "accuracy", folder_names=("RTE",),
                 tsv_label_map=_NLI2),
        # WNLI's TSV labels are already 0/1 with 1 = entailment, as on the hub.
        GlueTask("wnli", ("sentence1", "sentence2"), 2, ("accuracy",), "accuracy", folder_names=("WNLI",)),
    )
}
# The paper's Table 3 column order (WNLI is not in the table; `--task all` reports it after the average).
TABLE3_TASKS = ("mnli", "qnli", "qqp", "rte", "sst2", "mrpc", "cola", "stsb")
STSB_RANGE = (0.0, 5.0)


def get_task(name: str) -> GlueTask:
    if name not in GLUE_TASKS:
        raise ConfigError(f"unknown GLUE task {name!r}; known tasks: {sorted(GLUE_TASKS)}")
    return GLUE_TASKS[name]


def is_test_split(split: str) -> bool:
    return split.startswith("test")


# ------------------------------------------------------------------------------------------------ loading
def load_glue_split(task: GlueTask, split: str, path: str | Path | None = None):
    """One split as a `datasets.Dataset` with the hub's columns, from the hub (`path=None`) or local files.
    Labels are checked (see `check_labels`); a missing column or a bad label is a DataError naming the file."""
    if split not in task.splits:
        raise ValueError(f"GLUE {task.name} has no split {split!r}; its splits are {list(task.splits)}")
    if path is None:
        dataset, source = _load_from_hub(task, split), f"{HUB_DATASET} {task.name}/{split}"
    else:
        dataset, source = _load_local(task, split, Path(path))
    missing = [c for c in (*task.text_columns, "label") if c not in dataset.column_names]
    if missing:
        raise DataError(f"{source}: GLUE {task.name}/{split} needs the column(s) {missing}, which are missing "
                        f"(found {dataset.column_names})")
    if "idx" not in dataset.column_names:
        dataset = dataset.add_column("idx", list(range(len(dataset))))
    check_labels(task, split, list(dataset["label"]), source)
    return dataset


def _load_from_hub(task: GlueTask, split: str):
    try:
        require_hub(HUB_DATASET, "data.path")
    except HubUnreachableError as err:
        raise HubUnreachableError(
            f"{err} For example `data.path=/data/glue` with either the hub's parquet layout "
            f"(/data/glue/{task.name}/train.parquet, validation.parquet, ...) or the original GLUE TSV layout "
            f"(/data/glue/{task.name}/train.tsv, dev.tsv, ...)."
        ) from err
    return datasets.load_dataset(HUB_DATASET, task.name, split=split)


def task_directory(task: GlueTask, root: Path) -> Path:
    """`root/<task>` (hub or original GLUE folder name), or `root` itself when it holds the split files."""
    if not root.is_dir():
        raise FileNotFoundError(f"data.path={str(root)!r} is not a directory")
    for name in (task.name, *task.folder_names):
        if (root / name).is_dir():
            return root / name
    return root


def _load_local(task: GlueTask, split: str, root: Path):
    """(the split as a Dataset, the file or files it was read from, for messages)."""
    directory = task_directory(task, root)
    parquet = sorted(directory.glob(f"{split}.parquet")) or sorted(directory.glob(f"{split}-*.parquet"))
    if parquet:
        tables = []
        for file in parquet:
            try:
                tables.append(pq.read_table(str(file)))
            except pa.ArrowException as err:
                raise DataError(f"{file}: not a readable parquet file (corrupt or truncated?): {err}") from err
        # Read in memory (no Arrow cache files written beside the user's data or in the HF cache).
        source = str(parquet[0]) if len(parquet) == 1 else f"{directory}/{{{','.join(p.name for p in parquet)}}}"
        return datasets.concatenate_datasets([datasets.Dataset(table) for table in tables]), source
    tsv = directory / _tsv_name(split)
    if tsv.is_file():
        return datasets.Dataset.from_dict(read_glue_tsv(task, split, tsv)), str(tsv)
    raise FileNotFoundError(
        f"GLUE {task.name}/{split}: no {split}.parquet, {split}-*.parquet or {tsv.name} in {directory} "
        f"(data.path={str(root)!r})"
    )


def _tsv_name(split: str) -> str:
    return split.replace("validation", "dev") + ".tsv"  # validation_matched -> dev_matched.tsv


def read_glue_tsv(task: GlueTask, split: str, path: Path) -> dict[str, list]:
    """Reads an original GLUE TSV into hub columns. The files contain bare quote characters, so no quoting."""
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            headerless = task.tsv_headerless_fields is not None and not is_test_split(split)
            reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE,
                                    fieldnames=task.tsv_headerless_fields if headerless else None)
            rows = list(reader)
            fieldnames = reader.fieldnames or []
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text: {err}") from err
    columns = {hub: task.tsv_columns.get(hub, hub) for hub in task.text_columns}
    absent = [tsv for tsv in columns.values() if tsv not in fieldnames]
    if absent:
        raise DataError(f"{path}: columns {absent} are missing (header: {fieldnames})")
    has_labels = task.tsv_label_column in fieldnames
    if not has_labels and not is_test_split(split):
        raise DataError(f"{path}: the label column {task.tsv_label_column!r} is missing (header: {fieldnames})")
    out: dict[str, list] = {hub: [] for hub in task.text_columns}
    out["label"], out["idx"] = [], []
    for line, row in enumerate(rows, start=1 if headerless else 2):
        if None in row:  # DictReader files surplus fields under the key None
            raise DataError(f"{path}:{line}: {len(fieldnames) + len(row[None])} fields, expected {len(fieldnames)}")
        for hub, tsv in columns.items():
            if row[tsv] is None:
                raise DataError(f"{path}:{line}: column {tsv!r} is missing")
            out[hub].append(row[tsv])
        out["label"].append(_tsv_label(task, row[task.tsv_label_column], path, line) if has_labels else TEST_LABEL)
        out["idx"].append(len(out["idx"]))
    return out


def _tsv_label(task: GlueTask, value: Optional[str], path: Path, line: int):
    if value is None or value.strip() == "":
        raise DataError(f"{path}:{line}: the label is missing")
    value = value.strip()
    if task.tsv_label_map is not None:
        if value not in task.tsv_label_map:
            raise DataError(f"{path}:{line}: label {value!r} is not one of {sorted(task.tsv_label_map)}")
        return task.tsv_label_map[value]
    try:
        number = float(value)
    except ValueError:
        raise DataError(f"{path}:{line}: label {value!r} is not a number") from None
    if task.is_regression:
        return number
    if not number.is_integer():
        raise DataError(f"{path}:{line}: label {value!r} is not a class: GLUE {task.name} labels are the integers 0 "
                        f"to {task.num_labels - 1}")
    return int(number)


def check_labels(task: GlueTask, split: str, labels: Sequence, source: str | None = None) -> None:
    """Missing or out-of-range labels are a DataError naming `source` (the file); -1 (unlabelled) only in test
    splits, for prediction."""
    where = f"{source}: " if source else ""
    bad = []
    for i, label in enumerate(labels):
        if label is None or (isinstance(label, float) and math.isnan(label)):
            raise DataError(f"{where}GLUE {task.name}/{split}: row {i} has no label")
        if is_test_split(split) and label == TEST_LABEL:
            continue
        if task.is_regression:
            ok = STSB_RANGE[0] <= label <= STSB_RANGE[1]
        else:
            ok = float(label).is_integer() and 0 <= label < task.num_labels
        if not ok:
            bad.append((i, label))
    if bad:
        allowed = (f"scores in [{STSB_RANGE[0]}, {STSB_RANGE[1]}]" if task.is_regression
                   else f"integers in [0, {task.num_labels})")
        unlabelled = " (-1 marks unlabelled rows and is only allowed in test splits)" if any(
            label == TEST_LABEL for _, label in bad) else ""
        raise DataError(f"{where}GLUE {task.name}/{split}: {len(bad)} labels out of range, expected "
                        f"{allowed}{unlabelled}; first (row, label): {bad[:5]}")


# ------------------------------------------------------------------------------------------------ tokenization
class TokenizedGlue(Dataset):
    """Token ids per example, plus label and hub `idx`. Pairs are encoded as the tokenizer's pair template."""

    def __init__(self, task: GlueTask, split: str, dataset, tokenizer, max_length: int):
        self.task, self.split = task, split
        texts = [list(dataset[column]) for column in task.text_columns]
        for column, values in zip(task.text_columns, texts):
            empty = [i for i, v in enumerate(values) if v is None]
            if empty:
                raise DataError(f"GLUE {task.name}/{split}: column {column!r} is missing in rows {empty[:5]}")
        encoded = tokenizer(*texts, truncation=True, max_length=max_length)
        self.input_ids: list[list[int]] = encoded["input_ids"]
        self.token_type_ids: Optional[list[list[int]]] = encoded.get("token_type_ids")
        dtype = torch.float32 if task.is_regression else torch.long
        self.labels = torch.tensor(list(dataset["label"]), dtype=dtype)
        self.idx = torch.tensor(list(dataset["idx"]), dtype=torch.long)
        truncated = sum(len(ids) >= max_length for ids in self.input_ids)
        if truncated:
            log.info("GLUE %s/%s: %d of %d examples truncated to %d tokens", task.name, split, truncated,
                     len(self), max_length)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": self.input_ids[i], "labels": self.labels[i], "idx": self.idx[i]}
        if self.token_type_ids is not None:
            item["token_type_ids"] = self.token_type_ids[i]
        return item

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]
