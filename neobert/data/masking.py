"""Masked-language-model inputs: choose the masked positions, replace them, build padded or packed batches.

Two strategies (paper Section 3 and its ablation M5):
* ``all_mask``: every chosen token becomes [MASK] (NeoBERT, 20%).
* ``bert``: of the chosen tokens 80% become [MASK], 10% a random non-special token, 10% stay (BERT, M0, 15%).
Special tokens ([CLS], [SEP], ...) and padding are never chosen. Labels hold the original id at chosen
positions and -100 elsewhere, so the loss is computed on masked positions only.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100


class MLMMasker:
    def __init__(self, mask_token_id: int, pad_token_id: int, special_token_ids, vocab_size: int,
                 rate: float = 0.2, strategy: str = "all_mask", pad_to_multiple_of: int = 8):
        if strategy not in ("all_mask", "bert"):
            raise ValueError(f"masking strategy must be 'all_mask' or 'bert', got {strategy!r}")
        if not 0.0 < rate < 1.0:
            raise ValueError(f"masking rate must be in (0, 1), got {rate}")
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.special_token_ids = torch.tensor(sorted(set(special_token_ids) | {pad_token_id}), dtype=torch.long)
        self.rate = rate
        self.strategy = strategy
        self.pad_to_multiple_of = pad_to_multiple_of
        # Random replacements (bert strategy) are drawn from the ordinary tokens only.
        ordinary = torch.ones(vocab_size, dtype=torch.bool)
        ordinary[self.special_token_ids[self.special_token_ids < vocab_size]] = False
        self.random_token_ids = ordinary.nonzero().squeeze(1)

    @classmethod
    def from_tokenizer(cls, tokenizer, rate: float = 0.2, strategy: str = "all_mask", pad_to_multiple_of: int = 8):
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("MLM pretraining needs a tokenizer with a [MASK] and a [PAD] token")
        return cls(tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.all_special_ids, len(tokenizer),
                   rate, strategy, pad_to_multiple_of)

    def maskable(self, input_ids: Tensor) -> Tensor:
        return ~torch.isin(input_ids, self.special_token_ids)

    def mask(self, input_ids: Tensor, generator: torch.Generator | None = None,
             rate: float | None = None) -> tuple[Tensor, Tensor]:
        """Returns (masked input ids, labels); `input_ids` is left unchanged. `rate` (default: the masker's) is
        what a masking-rate schedule sets per step."""
        rate = self.rate if rate is None else rate
        chosen = (torch.rand(input_ids.shape, generator=generator) < rate) & self.maskable(input_ids)
        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        inputs = input_ids.clone()
        if self.strategy == "all_mask":
            inputs[chosen] = self.mask_token_id
            return inputs, labels
        action = torch.rand(input_ids.shape, generator=generator)
        to_mask = chosen & (action < 0.8)
        to_random = chosen & (action >= 0.8) & (action < 0.9)
        inputs[to_mask] = self.mask_token_id
        picks = torch.randint(len(self.random_token_ids), (int(to_random.sum()),), generator=generator)
        inputs[to_random] = self.random_token_ids[picks]
        return inputs, labels

    def collate_padded(self, docs: list[list[int]], generator: torch.Generator | None = None,
                       rate: float | None = None) -> dict:
        """Documents (already truncated) -> right-padded batch, length rounded up to `pad_to_multiple_of`."""
        longest = max(len(d) for d in docs)
        multiple = self.pad_to_multiple_of
        length = -(-longest // multiple) * multiple
        input_ids = torch.full((len(docs), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(docs), length), dtype=torch.long)
        for row, doc in enumerate(docs):
            input_ids[row, : len(doc)] = torch.tensor(doc, dtype=torch.long)
            attention_mask[row, : len(doc)] = 1
        inputs, labels = self.mask(input_ids, generator, rate)
        return {"input_ids": inputs, "attention_mask": attention_mask, "labels": labels,
                "masked_index": masked_index(labels)}

    def collate_unpadded(self, docs: list[list[int]], generator: torch.Generator | None = None,
                         rate: float | None = None) -> dict:
        """Documents (already truncated) -> the padded batch of `collate_padded` with its [PAD] removed: each document
        its own sequence, laid end to end in one row [1, tokens] and marked by `cu_seqlens` (int32), as a packed
        batch (no attention_mask, no cross-document attention, positions restart per document), so no pad token
        goes through a matmul and varlen kernels (FlashAttention) apply. The masks are drawn exactly as for the
        padded batch (same generator draws), so both hold the same documents, masked positions and loss."""
        padded = self.collate_padded(docs, generator, rate)
        keep = padded["attention_mask"].reshape(-1).bool()
        lengths = torch.tensor([len(d) for d in docs], dtype=torch.int32)
        cu_seqlens = torch.zeros(len(docs) + 1, dtype=torch.int32)
        cu_seqlens[1:] = lengths.cumsum(0)
        inputs, labels = padded["input_ids"].reshape(-1)[keep][None], padded["labels"].reshape(-1)[keep][None]
        return {"input_ids": inputs, "labels": labels, "cu_seqlens": cu_seqlens, "max_seqlen": int(lengths.max()),
                "masked_index": masked_index(labels)}

    def collate_packed(self, rows: list[list[list[int]]], generator: torch.Generator | None = None,
                       rate: float | None = None) -> dict:
        """Rows, each a list of document segments laid end to end -> a packed batch.

        No [PAD] anywhere: `cu_seqlens` (int32, over the flattened ids) marks every segment, so no document
        attends to another and positions restart per document; there is no attention_mask. Rows of one length
        (greedy packing) give input_ids of shape [rows, length]; rows of different lengths (best fit) are laid
        end to end in one row, [1, tokens], rather than padded.
        """
        lengths = [len(segment) for row in rows for segment in row]
        flat = [token for row in rows for segment in row for token in segment]
        # Padding unequal rows to one length would put [PAD] back in; cu_seqlens alone separates the documents.
        equal_rows = len({sum(len(segment) for segment in row) for row in rows}) == 1
        shape = (len(rows), len(flat) // len(rows)) if equal_rows else (1, len(flat))
        input_ids = torch.tensor(flat, dtype=torch.long).view(shape)
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        inputs, labels = self.mask(input_ids, generator, rate)
        return {"input_ids": inputs, "labels": labels, "cu_seqlens": cu_seqlens, "max_seqlen": max(lengths),
                "masked_index": masked_index(labels)}


def masked_index(labels: Tensor) -> Tensor:
    """Flat indices of the masked positions (labels != -100), found here on the host where the batch is built, so
    that the model's masked-only logits need not look for them on the device (NeoBERTForMaskedLM masked_index)."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
