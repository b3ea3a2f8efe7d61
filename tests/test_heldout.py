"""The ladder's held-out scores: the MLM loss at a fixed masking rate equals a hand computation over the same
masked positions, every model sees the same positions, and the pseudo-perplexity pools every token."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from neobert.data.tokenizer import load_tokenizer
from neobert.eval.heldout import heldout_mlm_loss, heldout_pseudo_perplexity
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

SENTENCES = ["the parser reads one token at a time and builds a tree of nodes",
             "a list keeps its items in the order they were added",
             "the weather was mild and the river ran slowly past the town",
             "errors are raised when a file cannot be opened for reading"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("bert-base-uncased")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"content": f"{s}, document {i}."}) + "\n"
                            for i, s in enumerate(SENTENCES * 5)))
    return str(path)


def tiny_model(tokenizer, seed: int) -> NeoBERTForMaskedLM:
    torch.manual_seed(seed)
    return NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", vocab_size=len(tokenizer), max_length=64)).eval()


def test_heldout_loss_equals_a_hand_computation_on_the_same_masks(tokenizer, corpus):
    from neobert.config.pretrain import MaskingConfig
    from neobert.data.pretraining import validation_batches
    from neobert.eval.heldout import heldout_data

    model = tiny_model(tokenizer, 0)
    scores = heldout_mlm_loss(model, tokenizer, corpus, documents=12, max_length=16, mask_rate=0.15, batch_size=5)
    assert scores["documents"] == 12
    # by hand: the full logits at every masked position of the same fixed-seed batches
    data = heldout_data(corpus, 12, 16)
    batches = validation_batches(data, MaskingConfig(rate=0.15, strategy="all_mask"), tokenizer, 5)
    nll, correct, masked, maskable = 0.0, 0, 0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch["input_ids"], batch["attention_mask"]).logits
            where = batch["labels"] != -100
            assert (batch["input_ids"][where] == tokenizer.mask_token_id).all()  # all [MASK], no 80/10/10
            nll += float(F.cross_entropy(logits[where], batch["labels"][where], reduction="sum"))
            correct += int((logits[where].argmax(-1) == batch["labels"][where]).sum())
            masked += int(where.sum())
            special = torch.isin(batch["input_ids"], torch.tensor(tokenizer.all_special_ids)) & ~where
            maskable += int(batch["attention_mask"].sum()) - int(special.sum())
    assert scores["masked_tokens"] == masked and 0.1 < masked / maskable < 0.2
    assert scores["loss"] == pytest.approx(nll / masked, rel=1e-5)
    assert scores["accuracy"] == pytest.approx(correct / masked)
    # a random model of this vocabulary is near the uniform loss
    assert abs(scores["loss"] - math.log(len(tokenizer))) < 1.0


def test_every_model_is_scored_on_the_same_positions(tokenizer, corpus):
    first = heldout_mlm_loss(tiny_model(tokenizer, 0), tokenizer, corpus, documents=8, max_length=16)
    again = heldout_mlm_loss(tiny_model(tokenizer, 0), tokenizer, corpus, documents=8, max_length=16)
    other = heldout_mlm_loss(tiny_model(tokenizer, 1), tokenizer, corpus, documents=8, max_length=16)
    assert first == again  # masks and documents fixed: a deterministic score
    assert other["masked_tokens"] == first["masked_tokens"] and other["loss"] != first["loss"]
    reseeded = heldout_mlm_loss(tiny_model(tokenizer, 0), tokenizer, corpus, documents=8, max_length=16, seed=1)
    assert reseeded["loss"] != first["loss"]  # the mask seed is what fixes the positions


def test_pseudo_perplexity_pools_every_token_of_the_first_documents(tokenizer, corpus):
    from neobert.eval.pseudo_perplexity import token_nlls

    model = tiny_model(tokenizer, 0)
    scores = heldout_pseudo_perplexity(model, tokenizer, corpus, documents=3, max_length=10)
    special = set(tokenizer.all_special_ids)
    nlls = []
    for i in range(3):
        ids = tokenizer(json.loads(open(corpus).readlines()[i])["content"])["input_ids"]
        ids = ids[:9] + [ids[-1]]  # truncated to 10, the closing [SEP] kept
        ids = torch.tensor(ids)
        scored = torch.tensor([int(t) not in special for t in ids])
        with torch.no_grad():
            nlls.append(token_nlls(model, ids, scored, tokenizer.mask_token_id))
    nll = torch.cat(nlls)
    assert scores["documents"] == 3 and scores["scored_tokens"] == nll.numel() == 3 * 8
    assert scores["pseudo_perplexity"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)


def test_a_corpus_without_text_is_an_error(tokenizer, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"content": ""}) + "\n" + json.dumps({"content": "   "}) + "\n")
    with pytest.raises(ValueError, match="no token was masked"):
        heldout_mlm_loss(tiny_model(tokenizer, 0), tokenizer, str(empty), documents=1, max_length=8)
