"""Masking statistics: rate, special tokens and padding never masked, the 80/10/10 split, padding to 8."""

import torch

from neobert.data.masking import IGNORE_INDEX, MLMMasker
from neobert.data.tokenizer import load_tokenizer


def _batch(tokenizer, rows=64, length=512):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, len(tokenizer), (rows, length), generator=generator)
    ids[:, 0] = tokenizer.cls_token_id
    ids[:, 100] = tokenizer.sep_token_id
    ids[:, -50:] = tokenizer.pad_token_id
    return ids


def test_all_mask_rate_and_specials():
    tokenizer = load_tokenizer()
    masker = MLMMasker.from_tokenizer(tokenizer, rate=0.2, strategy="all_mask")
    ids = _batch(tokenizer)
    inputs, labels = masker.mask(ids, torch.Generator().manual_seed(0))
    chosen = labels != IGNORE_INDEX
    maskable = masker.maskable(ids)
    assert not chosen[~maskable].any(), "special or pad tokens were masked"
    rate = chosen.sum().item() / maskable.sum().item()
    assert abs(rate - 0.2) < 0.005, rate
    assert (inputs[chosen] == tokenizer.mask_token_id).all()
    assert torch.equal(inputs[~chosen], ids[~chosen])
    assert torch.equal(labels[chosen], ids[chosen])


def test_bert_80_10_10_split():
    tokenizer = load_tokenizer()
    masker = MLMMasker.from_tokenizer(tokenizer, rate=0.15, strategy="bert")
    ids = _batch(tokenizer)
    inputs, labels = masker.mask(ids, torch.Generator().manual_seed(0))
    chosen = labels != IGNORE_INDEX
    assert not chosen[~masker.maskable(ids)].any()
    assert abs(chosen.sum().item() / masker.maskable(ids).sum().item() - 0.15) < 0.005
    n = chosen.sum().item()
    masked = (inputs[chosen] == tokenizer.mask_token_id).sum().item() / n
    kept = (inputs[chosen] == ids[chosen]).sum().item() / n
    replaced = 1 - masked - kept
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.02 and abs(replaced - 0.1) < 0.02, (masked, kept)
    random_tokens = inputs[chosen & (inputs != tokenizer.mask_token_id) & (inputs != ids)]
    assert not torch.isin(random_tokens, torch.tensor(tokenizer.all_special_ids)).any()


def test_collate_padded_to_multiple_of_8_and_packed_has_no_pad():
    tokenizer = load_tokenizer()
    masker = MLMMasker.from_tokenizer(tokenizer, rate=0.2)
    docs = [[101, 2000, 2001, 102], [101] + [3000] * 9 + [102]]
    batch = masker.collate_padded(docs)
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"].sum(1).tolist() == [4, 11]
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    packed = masker.collate_packed([[[101, 5, 6, 102], [101, 7, 102, 0 + 8]], [[9] * 8]])
    assert packed["cu_seqlens"].tolist() == [0, 4, 8, 16]
    assert "attention_mask" not in packed
