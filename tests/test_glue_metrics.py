"""GLUE metrics against independent references (scikit-learn, scipy) on random predictions, accumulated over
several batches as during validation."""

import pytest
import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from neobert.data.glue import get_task
from neobert.eval.glue_metrics import GlueMetrics, compute_glue_metrics, main_score_key, table3_markdown


def accumulate(task_name: str, split_data: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    metrics = GlueMetrics(get_task(task_name))
    for split, (logits, labels) in split_data.items():
        for chunk_logits, chunk_labels in zip(logits.split(37), labels.split(37)):
            metrics.update(split, chunk_logits, chunk_labels)
    return metrics.compute()


def random_classification(n: int, num_labels: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_labels, (n,), generator=g)
    logits = torch.randn(n, num_labels, generator=g)
    logits[torch.arange(n), labels] += 0.8  # better than chance, not perfect
    return logits, labels


@pytest.mark.parametrize("seed", range(3))
def test_cola_matthews(seed):
    logits, labels = random_classification(501, 2, seed)
    got = accumulate("cola", {"validation": (logits, labels)})
    assert got["matthews_correlation"] == pytest.approx(matthews_corrcoef(labels, logits.argmax(1)), abs=1e-6)


@pytest.mark.parametrize("task_name", ["mrpc", "qqp"])
def test_f1_and_accuracy(task_name):
    logits, labels = random_classification(733, 2, 7)
    got = accumulate(task_name, {"validation": (logits, labels)})
    preds = logits.argmax(1).numpy()
    assert got["f1"] == pytest.approx(f1_score(labels.numpy(), preds), abs=1e-6)  # positive class 1
    assert got["accuracy"] == pytest.approx(accuracy_score(labels.numpy(), preds), abs=1e-6)


@pytest.mark.parametrize("task_name", ["sst2", "qnli", "rte", "wnli"])
def test_accuracy(task_name):
    logits, labels = random_classification(300, 2, 3)
    got = accumulate(task_name, {"validation": (logits, labels)})
    assert set(got) == {"accuracy"}
    assert got["accuracy"] == pytest.approx(accuracy_score(labels, logits.argmax(1)), abs=1e-6)


def test_stsb_pearson_and_spearman():
    g = torch.Generator().manual_seed(0)
    labels = torch.rand(400, generator=g) * 5
    predictions = labels + torch.randn(400, generator=g) * 1.5
    got = accumulate("stsb", {"validation": (predictions.unsqueeze(1), labels)})  # the model's [N, 1] output
    assert got["pearson"] == pytest.approx(pearsonr(predictions.numpy(), labels.numpy())[0], abs=1e-5)
    assert got["spearman"] == pytest.approx(spearmanr(predictions.numpy(), labels.numpy())[0], abs=1e-5)


def test_mnli_matched_and_mismatched_are_separate():
    matched = random_classification(450, 3, 1)
    mismatched = random_classification(380, 3, 2)
    mismatched[0][:, 0] += 3.0  # a different, worse classifier on the mismatched split
    got = accumulate("mnli", {"validation_matched": matched, "validation_mismatched": mismatched})
    assert got["accuracy_matched"] == pytest.approx(accuracy_score(matched[1], matched[0].argmax(1)), abs=1e-6)
    assert got["accuracy_mismatched"] == pytest.approx(
        accuracy_score(mismatched[1], mismatched[0].argmax(1)), abs=1e-6)
    assert got["accuracy_matched"] != pytest.approx(got["accuracy_mismatched"])
    assert main_score_key(get_task("mnli")) == "accuracy_matched"


def test_one_call_helper_and_reset():
    logits, labels = random_classification(200, 2, 5)
    got = compute_glue_metrics(get_task("mrpc"), "validation", logits.numpy(), labels.numpy())
    assert got["f1"] == pytest.approx(f1_score(labels, logits.argmax(1)), abs=1e-6)
    metrics = GlueMetrics(get_task("rte"))
    metrics.update("validation", *random_classification(50, 2, 9))
    metrics.reset()
    metrics.update("validation", logits, labels)
    assert metrics.compute()["accuracy"] == pytest.approx(accuracy_score(labels, logits.argmax(1)))


def test_table3_layout_and_average():
    scores = {"rte": {"accuracy": 0.7, "score": 0.7}, "stsb": {"pearson": 0.8, "spearman": 0.79, "score": 0.8}}
    table = table3_markdown("m", scores)
    header, _, row = table.splitlines()[:3]
    assert header.split("|")[2:11] == [" MNLI ", " QNLI ", " QQP ", " RTE ", " SST ", " MRPC ", " CoLA ", " STS ",
                                        " Avg "]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[4] == "70.0" and cells[8] == "80.0" and cells[9].startswith("75.0 (2 of 8")
    assert "| stsb | spearman | 79.00 |" in table
