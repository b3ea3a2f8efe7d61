"""GLUE metrics exactly as GLUE defines them, with torchmetrics (so they accumulate over batches and devices):
Matthews correlation (CoLA), F1 of the positive class and accuracy (MRPC, QQP), Pearson and Spearman
correlation (STS-B), matched and mismatched accuracy (MNLI), accuracy otherwise."""

from __future__ import annotations

import statistics
from typing import Callable

import torch
from torch import Tensor, nn
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryF1Score, MatthewsCorrCoef, MulticlassAccuracy
from torchmetrics.regression import PearsonCorrCoef, SpearmanCorrCoef

from neobert.data.glue import GLUE_TASKS, TABLE3_TASKS, GlueTask

METRICS: dict[str, Callable[[int], Metric]] = {
    # average="micro" is the plain fraction of correct predictions.
    "accuracy": lambda num_labels: MulticlassAccuracy(num_classes=num_labels, average="micro"),
    "f1": lambda num_labels: BinaryF1Score(),  # F1 of class 1 (paraphrase / duplicate), as GLUE scores it
    "matthews_correlation": lambda num_labels: MatthewsCorrCoef(task="multiclass", num_classes=num_labels),
    "pearson": lambda num_labels: PearsonCorrCoef(),
    "spearman": lambda num_labels: SpearmanCorrCoef(),
}


def metric_key(task: GlueTask, metric: str, split: str) -> str:
    """`accuracy`, or `accuracy_matched` / `accuracy_mismatched` for tasks with several validation splits."""
    if len(task.validation_splits) == 1:
        return metric
    return f"{metric}_{split.removeprefix('validation_')}"


def main_score_key(task: GlueTask) -> str:
    """The key of the score that selects the best checkpoint: the main metric on the first validation split."""
    return metric_key(task, task.main_metric, task.validation_splits[0])


def predictions(task: GlueTask, logits: Tensor) -> Tensor:
    """Regression: the single output; classification: the arg-max class."""
    return logits.squeeze(-1).float() if task.is_regression else logits.argmax(dim=-1)


class GlueMetrics(nn.Module):
    """One metric collection per validation split. update(split, logits, labels); compute() -> {key: float}."""

    def __init__(self, task: GlueTask):
        super().__init__()
        self.task = task
        self.per_split = nn.ModuleDict({
            split: MetricCollection({name: METRICS[name](task.num_labels) for name in task.metrics})
            for split in task.validation_splits
        })

    def update(self, split: str, logits: Tensor, labels: Tensor) -> None:
        self.per_split[split].update(predictions(self.task, logits), labels)

    def compute(self) -> dict[str, float]:
        scores = {}
        for split, collection in self.per_split.items():
            for name, value in collection.compute().items():
                scores[metric_key(self.task, name, split)] = float(value)
        return scores

    def reset(self) -> None:
        for collection in self.per_split.values():
            collection.reset()


def compute_glue_metrics(task: GlueTask, split: str, logits, labels) -> dict[str, float]:
    """A task's metrics on one split in one call (used by the plain Hugging Face Trainer baseline)."""
    collection = MetricCollection({name: METRICS[name](task.num_labels) for name in task.metrics})
    collection.update(predictions(task, torch.as_tensor(logits)), torch.as_tensor(labels))
    return {metric_key(task, name, split): float(value) for name, value in collection.compute().items()}


TABLE3_HEADERS = {"mnli": "MNLI", "qnli": "QNLI", "qqp": "QQP", "rte": "RTE", "sst2": "SST", "mrpc": "MRPC",
                  "cola": "CoLA", "stsb": "STS"}


def table3_markdown(model: str, scores: dict[str, dict[str, float]]) -> str:
    """The paper's Table 3 layout: one row, the main metric of each task x 100, the average over the Table 3
    tasks that ran (WNLI, not in the paper's table, after the average), then every metric of every task."""
    def main(task: str) -> float:
        return 100 * scores[task][main_score_key(GLUE_TASKS[task])]

    ran = [t for t in TABLE3_TASKS if t in scores]
    cells = [f"{main(t):.1f}" if t in scores else "-" for t in TABLE3_TASKS]
    average = f"{statistics.mean(main(t) for t in ran):.1f}" if ran else "-"
    if len(ran) < len(TABLE3_TASKS):
        average += f" ({len(ran)} of {len(TABLE3_TASKS)} tasks)"
    wnli = f"{main('wnli'):.1f}" if "wnli" in scores else "-"
    header = [TABLE3_HEADERS[t] for t in TABLE3_TASKS]
    lines = [
        "| Model | " + " | ".join(header) + " | Avg | WNLI |",
        "|---" * (len(header) + 3) + "|",
        f"| {model} | " + " | ".join(cells) + f" | {average} | {wnli} |",
        "",
        "Main metrics: " + ", ".join(f"{TABLE3_HEADERS.get(t, t)} {main_score_key(GLUE_TASKS[t])}"
                                     for t in (*TABLE3_TASKS, "wnli")) + " (dev sets).",
        "",
        "| task | " + " | ".join(["metric", "score"]) + " |",
        "|---|---|---|",
    ]
    for task, values in scores.items():
        for name, value in values.items():
            if name != "score":
                lines.append(f"| {task} | {name} | {100 * value:.2f} |")
    return "\n".join(lines) + "\n"
