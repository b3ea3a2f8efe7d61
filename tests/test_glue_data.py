import math

import pandas as pd
import pytest
import torch
from conftest import shared_data
from glue_files import set_tsv_label, write_parquet_task, write_tsv_task

from neobert.data.finetune import LengthGroupedSampler, PaddingCollator
from neobert.data.glue import GLUE_TASKS, TokenizedGlue, get_task, load_glue_split
from neobert.data.tokenizer import load_tokenizer
from neobert.hub import HubUnreachableError


@pytest.mark.parametrize("task_name", sorted(GLUE_TASKS))
def test_parquet_and_tsv_layouts_load_the_same_rows(tmp_path, task_name):
    task = get_task(task_name)
    frames = write_parquet_task(tmp_path / "parquet", task_name)
    folder = task.folder_names[0]  # the original GLUE folder name, e.g. STS-B, CoLA
    write_tsv_task(tmp_path / "tsv", task_name, frames, folder=folder)
    for split in task.splits:
        from_parquet = load_glue_split(task, split, tmp_path / "parquet")
        from_tsv = load_glue_split(task, split, tmp_path / "tsv")
        expected = frames[split]
        for column in (*task.text_columns, "idx"):
            assert from_parquet[column] == expected[column].tolist()
            assert from_tsv[column] == expected[column].tolist(), (split, column)
        if task.is_regression and not split.startswith("test"):
            assert from_tsv["label"] == pytest.approx(expected["label"].tolist(), abs=1e-3)
        else:
            assert from_tsv["label"] == expected["label"].tolist()
        assert from_parquet["label"] == pytest.approx(expected["label"].tolist())


def test_hub_file_names_and_a_task_folder_given_directly(tmp_path):
    frames = write_parquet_task(tmp_path, "mnli", hub_names=True)
    task = get_task("mnli")
    for root in (tmp_path, tmp_path / "mnli"):
        split = load_glue_split(task, "validation_mismatched", root)
        assert split["premise"] == frames["validation_mismatched"]["premise"].tolist()


def test_missing_files_name_what_was_looked_for(tmp_path):
    write_parquet_task(tmp_path, "rte")
    (tmp_path / "rte" / "validation.parquet").unlink()
    with pytest.raises(FileNotFoundError, match=r"validation\.parquet.*dev\.tsv"):
        load_glue_split(get_task("rte"), "validation", tmp_path)
    with pytest.raises(ValueError, match="no split 'dev'"):
        load_glue_split(get_task("rte"), "dev", tmp_path)


@pytest.mark.parametrize("label, split, message", [
    (2, "train", "out of range"),
    (-1, "validation", "only allowed in test splits"),
    (None, "train", "has no label"),
])
def test_bad_labels_are_clear_errors(tmp_path, label, split, message):
    frames = write_parquet_task(tmp_path, "rte")
    frame = frames[split].astype({"label": "object"})
    frame.loc[3, "label"] = label
    frame.to_parquet(tmp_path / "rte" / f"{split}.parquet")
    with pytest.raises(ValueError, match=message):
        load_glue_split(get_task("rte"), split, tmp_path)


def test_unlabelled_test_split_is_allowed_and_regression_range_checked(tmp_path):
    write_parquet_task(tmp_path, "rte")
    assert set(load_glue_split(get_task("rte"), "test", tmp_path)["label"]) == {-1}
    frames = write_parquet_task(tmp_path, "stsb")
    frames["train"].loc[0, "label"] = 5.5
    frames["train"].to_parquet(tmp_path / "stsb" / "train.parquet")
    with pytest.raises(ValueError, match=r"scores in \[0.0, 5.0\]"):
        load_glue_split(get_task("stsb"), "train", tmp_path)


def test_tsv_label_problems_name_the_line(tmp_path):
    frames = write_parquet_task(tmp_path / "p", "rte")
    directory = write_tsv_task(tmp_path / "t", "rte", frames)
    lines = set_tsv_label(directory, 3, "maybe")
    with pytest.raises(ValueError, match=r"train\.tsv:4: label 'maybe'"):
        load_glue_split(get_task("rte"), "train", tmp_path / "t")
    header = lines[0].replace("\tlabel", "")
    (directory / "dev.tsv").write_text(header + "\n" + "\n".join(l.rsplit("\t", 1)[0] for l in lines[1:]) + "\n")
    with pytest.raises(ValueError, match="label column 'label' is missing"):
        load_glue_split(get_task("rte"), "validation", tmp_path / "t")


def test_hub_offline_names_data_path_and_both_layouts(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachableError) as err:
        load_glue_split(get_task("rte"), "train", None)
    assert "data.path" in str(err.value) and "train.parquet" in str(err.value) and "dev.tsv" in str(err.value)


def test_tokenized_pairs_collator_and_length_grouping(tmp_path):
    frames = write_parquet_task(tmp_path, "mrpc", n_train=64)
    tokenizer = load_tokenizer()
    dataset = TokenizedGlue(get_task("mrpc"), "train", load_glue_split(get_task("mrpc"), "train", tmp_path),
                            tokenizer, max_length=20)
    first = tokenizer(frames["train"]["sentence1"][0], frames["train"]["sentence2"][0], truncation=True,
                      max_length=20)
    assert dataset[0]["input_ids"] == first["input_ids"] and max(dataset.lengths()) <= 20
    assert dataset[0]["token_type_ids"] == first["token_type_ids"]

    batch = PaddingCollator(tokenizer.pad_token_id)([dataset[i] for i in range(5)])
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].shape[1] < 8 + 20
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths == [len(dataset[i]["input_ids"]) for i in range(5)]
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tokenizer.pad_token_id).all()
    assert batch["labels"].dtype == torch.long and batch["token_type_ids"].shape == batch["input_ids"].shape


def test_length_grouped_sampler_groups_and_covers_every_example():
    lengths = [(i * 37) % 101 + 1 for i in range(1000)]
    sampler = LengthGroupedSampler(lengths, batch_size=10, seed=0, group_batches=20)
    order = list(sampler)
    assert sorted(order) == list(range(1000))
    assert list(sampler) != order  # a new shuffle every epoch
    batches = [order[i:i + 10] for i in range(0, 1000, 10)]
    padded = sum(10 * max(lengths[i] for i in b) for b in batches)
    assert max(lengths[i] for i in batches[0]) == max(lengths)  # the longest batch first
    # Random batches would pad to ~95 tokens a row; grouped ones pad little.
    assert padded / sum(lengths) < 1.2


def test_short_batch_stays_last_so_dataloader_batches_line_up():
    lengths = [(i * 7) % 25 + 1 for i in range(25)]  # 25 distinct lengths, one chunk, batches of 10
    for seed in range(5):
        order = list(LengthGroupedSampler(lengths, batch_size=10, seed=seed, group_batches=10))
        shortest = set(sorted(range(25), key=lengths.__getitem__)[:5])
        longest = set(sorted(range(25), key=lengths.__getitem__)[-10:])
        assert set(order[20:]) == shortest and set(order[:10]) == longest


def test_real_rte_parquet_and_stsb_tsv():
    root = shared_data("glue")
    rte, stsb = get_task("rte"), get_task("stsb")
    sizes = {s: len(load_glue_split(rte, s, root)) for s in rte.splits}
    assert sizes == {"train": 2490, "validation": 277, "test": 3000}
    train = load_glue_split(stsb, "train", root)
    dev = load_glue_split(stsb, "validation", root)
    assert (len(train), len(dev)) == (5749, 1500)
    assert train[0]["sentence1"] == "A plane is taking off." and train[0]["label"] == 5.0
    assert all(0 <= x <= 5 and not math.isnan(x) for x in dev["label"])
    assert pd.Series(load_glue_split(rte, "validation", root)["label"]).value_counts().to_dict() == {0: 146, 1: 131}
