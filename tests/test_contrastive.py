"""Contrastive data (formats, instructions, batching, unreachable sets), the sentence-transformers export, and a
short CPU run that lifts a local STS score above its zero-shot value."""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter

import pytest
import torch
from conftest import shared_data

from neobert.config import ConfigError, load_config
from neobert.config.contrastive import ContrastiveConfig, ContrastiveDataConfig
from neobert.data.contrastive import (
    ContrastiveBatchSampler,
    ContrastiveCorpus,
    ContrastiveExample,
    load_corpora,
    read_local_examples,
)
from neobert.hub import HubUnreachableError
from neobert.layout import EXPORT_DIR, metrics_csvs


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_local_formats_pairs_nli_and_sts(tmp_path):
    pairs = read_local_examples(_jsonl(tmp_path / "p.jsonl", [{"query": "q1", "positive": "p1", "negative": "n1"},
                                                              {"anchor": "q2", "positive": "p2"}][:1]))
    assert pairs == [ContrastiveExample("q1", "p1", ("n1",))]
    nli = read_local_examples(_jsonl(tmp_path / "nli.jsonl", [
        {"premise": "A man sings.", "hypothesis": "A person sings.", "label": "entailment"},
        {"premise": "A man sings.", "hypothesis": "Nobody sings.", "label": "contradiction"},
        {"premise": "A man sings.", "hypothesis": "He is on stage.", "label": "neutral"},
        {"premise": "Cats sleep.", "hypothesis": "Animals rest.", "label": 0}]))
    assert nli == [ContrastiveExample("A man sings.", "A person sings.", ("Nobody sings.",)),
                   ContrastiveExample("Cats sleep.", "Animals rest.")]
    sts = tmp_path / "sts.csv"
    sts.write_text("main\tf\t2012\t0001\t4.500\tA plane takes off.\tAn airplane departs.\n"
                   "main\tf\t2012\t0002\t1.000\tA dog barks.\tA man eats.\n")
    assert read_local_examples(sts, sts_min_score=4.0) == [ContrastiveExample("A plane takes off.",
                                                                              "An airplane departs.")]
    csv_file = tmp_path / "pairs.csv"
    csv_file.write_text('query,positive\n"What is 2+2, roughly?",Four\n')
    assert read_local_examples(csv_file) == [ContrastiveExample("What is 2+2, roughly?", "Four")]
    with pytest.raises(ValueError, match="columns"):
        read_local_examples(_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}]))
    with pytest.raises(ValueError, match="empty"):
        read_local_examples(_jsonl(tmp_path / "empty_q.jsonl", [{"query": " ", "positive": "p"}]))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_local_examples(tmp_path / "nope.jsonl")


def test_every_example_carries_its_datasets_instruction(tmp_path):
    local = _jsonl(tmp_path / "nli.jsonl", [{"anchor": f"a{i}", "positive": f"p{i}", "negative": f"n{i}"}
                                             for i in range(4)])
    mine = _jsonl(tmp_path / "mine.jsonl", [{"query": "q", "positive": "d"}])
    config = ContrastiveDataConfig(datasets=["AllNLI", "MSMARCO", "Mine"],
                                   local_files={"AllNLI": str(local), "MSMARCO": str(local), "Mine": str(mine)},
                                   instructions={"Mine": "Custom:"})
    corpora = {c.name: c.examples for c in load_corpora(config)}
    # AllNLI is symmetric: the same instruction on every side; it has no trailing space, so one is added.
    assert corpora["AllNLI"][0] == ContrastiveExample("Retrieve semantically similar text. a0",
                                                      "Retrieve semantically similar text. p0",
                                                      ("Retrieve semantically similar text. n0",))
    # MS MARCO is asymmetric: queries get the instruction, passages none.
    assert corpora["MSMARCO"][1].query.startswith("Given a web search query, retrieve relevant passages")
    assert corpora["MSMARCO"][1].query.endswith("Query: a1")
    assert corpora["MSMARCO"][1].positive == "p1" and corpora["MSMARCO"][1].negatives == ("n1",)
    assert corpora["Mine"][0] == ContrastiveExample("Custom: q", "Custom: d")
    no_negatives = load_corpora(ContrastiveDataConfig(datasets=["AllNLI"], local_files={"AllNLI": str(local)},
                                                      use_hard_negatives=False))
    assert all(e.negatives == () for e in no_negatives[0].examples)


def test_packaged_config_has_the_paper_protocol_and_the_old_keys_still_work():
    """The shipped config loads without warnings and equals the schema's defaults (the paper's protocol); the
    keys of the old `train` section and the trainer's logging keys still work, each warning with its new key."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packaged = load_config(ContrastiveConfig, "contrastive")
    assert packaged == ContrastiveConfig()
    assert packaged.loss.temperature == 0.07 and packaged.trainer.max_steps == 2000
    assert packaged.optimizer.lr == 2e-5 and packaged.optimizer.betas == [0.9, 0.999]
    assert packaged.scheduler.name == "linear" and packaged.scheduler.warmup_steps == 100
    assert packaged.trainer.gradient_clip_val == 1.0 and packaged.trainer.precision == "bf16-mixed"
    renamed = {"train.max_steps=7": ("trainer.max_steps", 7), "train.lr=0.001": ("optimizer.lr", 1e-3),
               "train.temperature=0.05": ("loss.temperature", 0.05),
               "train.grad_cache_chunk_size=8": ("loss.grad_cache_chunk_size", 8),
               "train.weight_decay=0.1": ("optimizer.weight_decay", 0.1),
               "train.betas=[0.9,0.98]": ("optimizer.betas", [0.9, 0.98]), "train.eps=1e-6": ("optimizer.eps", 1e-6),
               "train.warmup_steps=3": ("scheduler.warmup_steps", 3),
               "train.gradient_clip=0.5": ("trainer.gradient_clip_val", 0.5),
               "trainer.enable_progress_bar=false": ("logging.progress_bar", False),
               "trainer.log_every_n_steps=2": ("logging.log_every_n_steps", 2)}
    for override, (new_key, value) in renamed.items():
        with pytest.warns(FutureWarning, match=re.escape(repr(new_key))):
            config = load_config(ContrastiveConfig, None, [override])
        section, _, name = new_key.partition(".")
        assert getattr(getattr(config, section), name) == value, override
    with pytest.raises(ConfigError, match=r"trainer\.accumulate_grad_batches"):
        load_config(ContrastiveConfig, None, ["loss.grad_cache_chunk_size=8", "trainer.accumulate_grad_batches=2"])


def test_old_yaml_sections_still_load(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("train:\n  lr: 1.0e-4\n  max_steps: 7\ntrainer:\n  devices: 1\n  enable_progress_bar: false\n")
    with pytest.warns(FutureWarning) as warned:
        config = load_config(ContrastiveConfig, old)
    messages = " ".join(str(w.message) for w in warned)
    assert all(f"use {key!r}" in messages for key in ("optimizer.lr", "trainer.max_steps", "logging.progress_bar"))
    assert config.trainer.max_steps == 7 and config.optimizer.lr == 1e-4 and config.logging.progress_bar is False


def test_unreachable_dataset_names_itself_and_the_config_key(tmp_path):
    with pytest.raises(HubUnreachableError, match=r"GooAQ.*sentence-transformers/gooaq.*`data\.local_files\.GooAQ`"):
        load_corpora(ContrastiveDataConfig(datasets=["GooAQ"]))
    with pytest.raises(ValueError, match=r"NotADataset.*data\.local_files\.NotADataset"):
        load_corpora(ContrastiveDataConfig(datasets=["NotADataset"]))


def _corpus(name, n, repeat_every=0):
    # With repeat_every=k, example i shares its query with example i - k: in-batch false negatives to avoid.
    return ContrastiveCorpus(name, [ContrastiveExample(f"{name}-q{i - i % repeat_every if repeat_every else i}",
                                                       f"{name}-p{i}") for i in range(n)])


def test_batches_hold_one_dataset_no_repeated_text_and_follow_size_power_alpha():
    corpora = [_corpus("big", 1600, repeat_every=2), _corpus("small", 100)]
    sampler = ContrastiveBatchSampler(corpora, batch_size=8, alpha=0.5, seed=3, steps_per_epoch=2000)
    counts = Counter()
    for batch in sampler:
        datasets = {d for d, _, _ in batch}
        assert len(datasets) == 1, "a batch mixes data sets"
        texts = [t for d, i, _ in batch for t in (corpora[d].examples[i].query, corpora[d].examples[i].positive)]
        assert len(texts) == len(set(texts)), "a batch repeats a text"
        counts[datasets.pop()] += 1
    # size**0.5: sqrt(1600) : sqrt(100) = 40 : 10, so 80% of the batches come from "big" (not 94% as by size).
    assert counts[0] / sum(counts.values()) == pytest.approx(0.8, abs=0.03)


def test_ranks_share_the_dataset_and_split_the_global_batch():
    corpora = [_corpus("a", 64), _corpus("b", 64)]
    ranks = [list(ContrastiveBatchSampler(corpora, 4, 1.0, seed=1, rank=r, world_size=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 16
    for first, second in zip(*ranks):
        assert {d for d, _, _ in first} == {d for d, _, _ in second}
        assert not set(first) & set(second)
    with pytest.raises(ValueError, match="fewer examples than one global batch"):
        ContrastiveBatchSampler([_corpus("tiny", 5)], 4, 1.0, world_size=2)


def test_sentence_transformers_export_encodes_the_same_vectors(tmp_path):
    from sentence_transformers import SentenceTransformer

    from neobert.data.backbone import load_backbone
    from neobert.eval.mteb import embed_texts
    from neobert.model.sentence_transformers import export_sentence_transformers

    backbone = load_backbone("preset:tiny")
    export_sentence_transformers(backbone.encoder, backbone.tokenizer, tmp_path / "st")
    texts = ["A man is playing a guitar.", "Hello", "A much longer sentence, with punctuation and more words in it."]
    ours = embed_texts(backbone, texts, batch_size=2)
    st_model = SentenceTransformer(str(tmp_path / "st"), device="cpu", trust_remote_code=True)
    theirs = st_model.encode(texts, convert_to_tensor=True, batch_size=3)
    torch.testing.assert_close(theirs.cpu(), ours, rtol=1e-4, atol=1e-5)
    # The same directory is our hub layout: load_backbone reads identical weights.
    reloaded = embed_texts(load_backbone(str(tmp_path / "st")), texts)
    torch.testing.assert_close(reloaded, ours, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~10 s on an idle machine, up to ~50 s when the 2 cores are shared
def test_short_contrastive_run_beats_zero_shot_sts(tmp_path, capsys):
    """A tiny random NeoBERT trained briefly on STS-B train pairs scores higher on STS-B dev pairs (local STS task
    with the STS instruction) than before training; the run exports a sentence-transformers directory."""
    from experiments.contrastive import main
    from neobert.data.contrastive import read_sts_pairs

    train = [p for p in read_sts_pairs(shared_data("stsbenchmark", "sts-train.csv")) if p[2] >= 4.0][:400]
    dev = read_sts_pairs(shared_data("stsbenchmark", "sts-dev.csv"))[:300]
    train_file = _jsonl(tmp_path / "train.jsonl", [{"query": a, "positive": b} for a, b, _ in train])
    dev_file = tmp_path / "dev.csv"
    dev_file.write_text("".join(f"g\tf\ty\t{i}\t{s}\t{a}\t{b}\n" for i, (a, b, s) in enumerate(dev)))
    result = main(["--config", "contrastive", "--model", "preset:tiny", "--output-dir",
                   str(tmp_path / "run"), "data.datasets=[STSBenchmark]",
                   f"data.local_files.STSBenchmark={train_file}", f"eval_sts={dev_file}", "data.batch_size=16",
                   "data.max_length=48", "optimizer.lr=1e-3", "scheduler.warmup_steps=5", "trainer.max_steps=40",
                   "trainer.precision=32-true", "trainer.accelerator=cpu", "logging.progress_bar=false",
                   "eval_sts_dims=[16]"])
    with capsys.disabled():
        print(f"\nlocal STS (300 dev pairs) zero-shot {result['sts_zero_shot']:.4f} -> tuned {result['sts_tuned']:.4f}")
    assert result["steps"] == 40
    # Also scored on embeddings truncated to 16 of their 64 dimensions (eval_sts_dims), before and after.
    by_dim = result["sts_tuned_by_dim"]
    assert set(by_dim) == {"full", "16"} and by_dim["full"] == result["sts_tuned"]
    assert by_dim["16"] != result["sts_tuned"]
    assert result["sts_tuned"] > result["sts_zero_shot"] + 0.02, result
    assert (tmp_path / "run" / EXPORT_DIR / "modules.json").is_file()
    assert len(metrics_csvs(tmp_path / "run")) == 1  # logs/version_0/metrics.csv
