"""Masked-language-model inputs: choose the masked positions, replace them, build padded or packed batches.

Two strategies (paper Section 3 and its ablation M5):
* ``all_mask``: every chosen token becomes [MASK] (NeoBERT, 20%).
* ``bert``: of the chosen tokens 80% become [MASK], 10% a random non-special token, 10% stay (BERT, M0, 15%).
Special tokens ([CLS], [SEP], ...) and padding are never chosen. Labels hold the original id at chosen
positions and -100 elsewhere, so the loss is computed on masked positions only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from neobert.errors import DataError
from neobert.model.heads import IGNORE_INDEX


@dataclass(frozen=True)
class StaticShapes:
    """The one shape of every packed batch under data.static_shapes, so that a compiled model traces one graph for
    the whole run (without it each packed batch has its own token count, number of documents, longest document and
    number of masked positions, and torch.compile recompiles). The tokens and masks are those of the unpadded
    packed batch; only where they sit changes:

    * input_ids and labels are [rows, length]: packed row r from the start of row r, then [PAD] with label -100 (and
      rows beyond the batch's all [PAD]);
    * cu_seqlens has `documents` + 1 entries: each row's documents, then its [PAD] tail as a document of its own (so
      [PAD] attends to no real token and no real token to [PAD]), then zero-length documents (the last offset
      repeated) up to the fixed count. The batch's "documents" (an int, at most `documents`) counts the entries before
      that filler, [PAD] tails included. Only CUDA graphs need the fixed count: elsewhere
      MLMPretrainingModule.forward gives the model the entries up to "documents" alone, as a dynamic size of
      the compiled graph (FlashAttention's varlen kernels slow down on many empty documents);
      max_seqlen is `length`;
    * masked_index has `masked` entries: the masked positions, then a position whose label is -100, repeated (the
      loss ignores it; an accuracy must count the entries whose label is not -100, not the entries).
    """

    rows: int
    length: int
    documents: int
    masked: int

    @classmethod
    def for_packed_rows(cls, rows: int, length: int, documents_per_row: int, highest_rate: float) -> "StaticShapes":
        """`documents_per_row` (data.static_documents_per_row): 0 = max(8, length // 32), documents of 32 tokens
        on average (the demo corpus's average 120 tokens give 8.6 per row of 1,024). `masked`: the mean number of
        masked positions of rows x length maskable tokens at the run's highest masking rate plus six standard
        deviations (binomial): exceeded about once in 10^9 batches, and then the last ones are unmasked."""
        tokens = rows * length
        per_row = documents_per_row or max(8, length // 32)
        spread = 6 * math.sqrt(tokens * highest_rate * (1 - highest_rate))
        return cls(rows, length, rows * per_row, min(tokens, math.ceil(tokens * highest_rate + spread)))


def static_shapes_for(data, masking, micro_batch_size: int) -> StaticShapes | None:
    """The static shape of a run's packed batches (its data and masking sections), or None: off, or not packed."""
    if data.packing == "none" or str(data.static_shapes).lower() != "true":
        return None
    return StaticShapes.for_packed_rows(micro_batch_size, data.max_length, data.static_documents_per_row,
                                        masking.highest_rate)


class MLMMasker:
    """`static`: the one shape every packed batch is laid out in (`StaticShapes`, data.static_shapes); None = each
    packed batch as small as its rows, with no [PAD]."""

    def __init__(self, mask_token_id: int, pad_token_id: int, special_token_ids, vocab_size: int,
                 rate: float = 0.2, strategy: str = "all_mask", pad_to_multiple_of: int = 8,
                 static: StaticShapes | None = None):
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
        self.static = static
        # Random replacements (bert strategy) are drawn from the ordinary tokens only.
        ordinary = torch.ones(vocab_size, dtype=torch.bool)
        ordinary[self.special_token_ids[self.special_token_ids < vocab_size]] = False
        self.random_token_ids = ordinary.nonzero().squeeze(1)

    @classmethod
    def from_tokenizer(cls, tokenizer, rate: float = 0.2, strategy: str = "all_mask", pad_to_multiple_of: int = 8,
                       static: StaticShapes | None = None):
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("MLM pretraining needs a tokenizer with a [MASK] and a [PAD] token")
        return cls(tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.all_special_ids, len(tokenizer),
                   rate, strategy, pad_to_multiple_of, static)

    @classmethod
    def for_pretraining(cls, tokenizer, masking, data, micro_batch_size: int) -> "MLMMasker":
        """The masker of a pretraining run's masking and data sections (data.static_shapes: `static_shapes_for`)."""
        return cls.from_tokenizer(tokenizer, masking.rate, masking.strategy, masking.pad_to_multiple_of,
                                  static_shapes_for(data, masking, micro_batch_size))

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

        `cu_seqlens` (int32, over the flattened ids) marks every segment, so no document attends to another and
        positions restart per document; there is no attention_mask. Without `static`, no [PAD] anywhere: rows of
        one length (greedy packing) give input_ids of shape [rows, length]; rows of different lengths (best fit)
        are laid end to end in one row, [1, tokens], rather than padded. With `static` (data.static_shapes) every
        batch has its one shape, [PAD] after each row as a document of its own (`StaticShapes`); the masks are
        drawn as without it, so both hold the same tokens, masks and loss. A batch of more rows than that shape
        (the flushed rest of a finite set of documents: validation's last batch, with every open row) keeps its own.
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
        if self.static is not None and len(rows) <= self.static.rows:
            return self._static_packed(rows, inputs, labels)
        return {"input_ids": inputs, "labels": labels, "cu_seqlens": cu_seqlens, "max_seqlen": max(lengths),
                "masked_index": masked_index(labels)}

    def _static_packed(self, rows: list[list[list[int]]], inputs: Tensor, labels: Tensor) -> dict:
        """The packed batch of `rows` (its masked `inputs` and `labels`, end to end) in `self.static`'s shape."""
        static = self.static
        row_tokens = [sum(len(segment) for segment in row) for row in rows]
        if max(row_tokens) > static.length:
            raise ValueError(f"a static packed batch holds rows of at most {static.length} tokens, got one of "
                             f"{max(row_tokens)}")
        ends = []  # of the documents in the [rows, length] grid: each row's segments, then its [PAD] tail if any
        for row in range(static.rows):
            end = row * static.length
            for segment in rows[row] if row < len(rows) else ():
                end += len(segment)
                ends.append(end)
            if end < (row + 1) * static.length:
                ends.append((row + 1) * static.length)
        if len(ends) > static.documents:
            per_row = static.documents // static.rows
            raise DataError(f"a packed micro-batch holds {len(ends)} documents ([PAD] tails included), more than "
                            f"data.static_documents_per_row={per_row} allows in {static.rows} rows (under "
                            f"data.static_shapes cu_seqlens has a fixed length): set data.static_documents_per_row "
                            f"to {math.ceil(len(ends) / static.rows)} or more (resume=true goes on from the last "
                            f"checkpoint)")
        place = torch.cat([torch.arange(tokens) + row * static.length for row, tokens in enumerate(row_tokens)])
        grid_inputs = torch.full((static.rows * static.length,), self.pad_token_id, dtype=torch.long)
        grid_labels = torch.full_like(grid_inputs, IGNORE_INDEX)
        grid_inputs[place], grid_labels[place] = inputs.reshape(-1), labels.reshape(-1)
        index = masked_index(grid_labels)
        if index.numel() > static.masked:  # about once in 10^9 batches: the last ones get their token back, unmasked
            extra = index[static.masked :]
            grid_inputs[extra], grid_labels[extra] = grid_labels[extra], IGNORE_INDEX
            index = index[: static.masked]
        if index.numel() < static.masked:  # filled with a position the loss ignores (there is one: masked < tokens)
            ignored = (grid_labels == IGNORE_INDEX).nonzero()[0]
            index = torch.cat([index, ignored.expand(static.masked - index.numel())])
        cu_seqlens = torch.full((static.documents + 1,), static.rows * static.length, dtype=torch.int32)
        cu_seqlens[0] = 0
        cu_seqlens[1 : len(ends) + 1] = torch.tensor(ends, dtype=torch.int32)
        return {"input_ids": grid_inputs.view(static.rows, static.length),
                "labels": grid_labels.view(static.rows, static.length), "cu_seqlens": cu_seqlens,
                "max_seqlen": static.length, "masked_index": index, "documents": len(ends)}


def masked_index(labels: Tensor) -> Tensor:
    """Flat indices of the masked positions (labels != -100), found here on the host where the batch is built, so
    that the model's masked-only logits need not look for them on the device (NeoBERTForMaskedLM masked_index)."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
