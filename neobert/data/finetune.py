"""What the data of every fine-tuning task (GLUE, NER) shares: the DataModule's layout (`FineTuneDataModule`) and
the batching (`PaddingCollator`, dynamic padding; `LengthGroupedSampler`, the training order of
`data.group_by_length`).

A task's data module (`neobert.data.glue_datamodule.GlueDataModule`, `neobert.data.ner_datamodule.NerDataModule`)
adds only what is its own: which splits it reads and how (`setup`), and which it evaluates on.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator, Optional, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, Subset

from neobert.model.heads import IGNORE_INDEX

log = logging.getLogger(__name__)


def clipped_max_length(tokenizer, max_length: int) -> int:
    """`data.max_length`, clipped (and logged) to the tokenizer's `model_max_length` where that is smaller."""
    limit = min(max_length, getattr(tokenizer, "model_max_length", None) or max_length)
    if limit < max_length:
        log.info("data.max_length=%d clipped to the tokenizer's limit %d", max_length, limit)
    return limit


def pad_sequences(sequences: Sequence, value: int, pad_to_multiple_of: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded with `value` to the longest rounded up to `pad_to_multiple_of` ([B, width]), and the 1/0 mask of
    their real positions."""
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    width = math.ceil(int(lengths.max()) / pad_to_multiple_of) * pad_to_multiple_of
    padded = torch.full((len(sequences), width), value, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        padded[row, : len(sequence)] = torch.as_tensor(sequence)
    return padded, (torch.arange(width)[None, :] < lengths[:, None]).long()


class PaddingCollator:
    """Dynamic padding: each batch is padded to its own longest sequence (rounded up to `pad_to_multiple_of`), with
    its attention mask. `labels` are one per sequence (GLUE: a tensor each, stacked) or one per token (NER: a list
    per sentence, padded with IGNORE_INDEX, which the loss and the scores skip); `token_type_ids` (sentence pairs)
    are padded with 0 where the tokenizer gives them."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 8):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: list[dict]) -> dict:
        input_ids, attention_mask = pad_sequences([item["input_ids"] for item in items], self.pad_token_id,
                                                  self.pad_to_multiple_of)
        labels = [item["labels"] for item in items]
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": (pad_sequences(labels, IGNORE_INDEX, self.pad_to_multiple_of)[0] if isinstance(labels[0], list)
                       else torch.stack(labels)),
            "idx": torch.tensor([int(item["idx"]) for item in items], dtype=torch.long),
        }
        if "token_type_ids" in items[0]:
            batch["token_type_ids"], _ = pad_sequences([item["token_type_ids"] for item in items], 0,
                                                       self.pad_to_multiple_of)
        return batch


def megabatch_size(num_examples: int, batch_size: int) -> int:
    """Batches per mega-batch, as the Hugging Face `Trainer`'s `group_by_length` chooses them
    (`transformers.trainer_pt_utils.get_length_grouped_indices`): 50, or fewer so the data holds at least 4
    mega-batches, and at least 1."""
    return max(1, min(num_examples // (batch_size * 4), 50))


def length_grouped_indices(lengths: Sequence[int], batch_size: int, generator: torch.Generator,
                           group_batches: Optional[int] = None) -> list[int]:
    """One epoch's order of the Hugging Face `Trainer`'s length grouping, written out here (its algorithm, not its
    code): a random permutation, cut into mega-batches of `group_batches * batch_size` examples, each sorted by
    length, longest first, then the longest example of all swapped to the front so an out-of-memory error shows
    at once. Consecutive `batch_size` slices are the batches: each holds examples of similar length, drawn from a
    random `group_batches`-th of the data, and the mega-batches come in random order. `group_batches=None`: the
    Trainer's choice (`megabatch_size`)."""
    if group_batches is None:
        group_batches = megabatch_size(len(lengths), batch_size)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    size = group_batches * batch_size
    megabatches = [sorted(order[start:start + size], key=lambda i: lengths[i], reverse=True)
                   for start in range(0, len(order), size)]
    if megabatches:
        longest = max(range(len(megabatches)), key=lambda m: lengths[megabatches[m][0]])
        megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [i for megabatch in megabatches for i in megabatch]


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch of a run seeded `seed`: distinct for every pair (`seed + epoch` would give
    seed 1 the order of seed 0's second epoch; torch keeps only 32 bits of a seed, so the pair is hashed into them)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


class LengthGroupedSampler(Sampler[int]):
    """The training order of `data.group_by_length` (GLUE, NER): the Hugging Face `Trainer`'s length grouping
    (`length_grouped_indices`), so short examples do not pay for long ones while the data is drawn in a random
    order. Batches are consecutive `batch_size` slices, so only the last batch of the epoch can be short (the
    DataLoader's batches line up with these). Under DDP, Lightning's sampler wrapper splits this order between
    ranks, which keeps the shuffle but loosens the grouping. A new order every epoch, from (`seed`, `epoch`)
    (`epoch_seed`)."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0, group_batches: Optional[int] = None):
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.group_batches = group_batches
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        self.epoch += 1  # also advances when nobody calls set_epoch
        yield from length_grouped_indices(self.lengths, self.batch_size, generator, self.group_batches)


class FineTuneDataModule(L.LightningDataModule):
    """The data of one fine-tuning task: its splits read and tokenized once (the task's `setup` fills `train` with a
    tokenized split: a Dataset with `lengths()`), batched by `PaddingCollator`; `batch_size` and `seed` may change
    between runs of a sweep without reloading anything."""

    def __init__(self, task, tokenizer, config, seed: int = 0):
        super().__init__()
        self.task, self.tokenizer, self.config = task, tokenizer, config
        self.batch_size, self.seed = config.batch_size, seed
        self.max_length = clipped_max_length(tokenizer, config.max_length)
        self.collator = PaddingCollator(tokenizer.pad_token_id)
        self.train = None

    def train_dataloader(self) -> DataLoader:
        if self.config.group_by_length:
            sampler = LengthGroupedSampler(self.train.lengths(), self.batch_size, seed=self.seed)
        else:
            sampler = RandomSampler(self.train, generator=torch.Generator().manual_seed(self.seed))
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collator,
                          num_workers=self.config.num_workers)

    def eval_loader(self, dataset: Dataset) -> DataLoader:
        """`dataset` (a tokenized split) shortest first: evaluation order changes no metric, and sorting by length
        minimises padding."""
        lengths = dataset.lengths()
        ordered = Subset(dataset, sorted(range(len(dataset)), key=lengths.__getitem__))
        return DataLoader(ordered, batch_size=self.config.eval_batch_size, collate_fn=self.collator,
                          num_workers=self.config.num_workers)

    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train) / self.batch_size)
