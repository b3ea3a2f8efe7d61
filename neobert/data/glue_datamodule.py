"""The GLUE DataModule: one task's splits, tokenized once, batched by length (neobert.data.glue does the rest)."""

from __future__ import annotations

import logging
import math
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, RandomSampler, Subset

from neobert.config.glue import GlueDataConfig
from neobert.data.glue import (GlueCollator, GlueTask, LengthGroupedSampler, TokenizedGlue, clipped_max_length,
                                load_glue_split)

log = logging.getLogger(__name__)


class GlueDataModule(L.LightningDataModule):
    """Train and validation splits (and test splits for prediction) of one task, tokenized once; `batch_size`
    and `seed` may change between runs of a sweep without reloading anything."""

    def __init__(self, task: GlueTask, tokenizer, config: GlueDataConfig, seed: int = 0):
        super().__init__()
        self.task, self.tokenizer, self.config = task, tokenizer, config
        self.batch_size, self.seed = config.batch_size, seed
        self.max_length = clipped_max_length(tokenizer, config.max_length)
        self.collator = GlueCollator(tokenizer.pad_token_id)
        self.train: Optional[TokenizedGlue] = None
        self.validation: dict[str, Subset] = {}
        self.test: dict[str, Subset] = {}

    def _tokenized(self, split: str, limit: int, shuffle_seed: Optional[int] = None) -> TokenizedGlue:
        dataset = load_glue_split(self.task, split, self.config.path)
        if limit and limit < len(dataset):
            dataset = (dataset.shuffle(seed=shuffle_seed) if shuffle_seed is not None else dataset).select(range(limit))
        return TokenizedGlue(self.task, split, dataset, self.tokenizer, self.max_length)

    @staticmethod
    def _by_length(dataset: TokenizedGlue) -> Subset:
        # Evaluation order does not change any metric; sorting by length minimises padding.
        lengths = dataset.lengths()
        return Subset(dataset, sorted(range(len(dataset)), key=lengths.__getitem__))

    def setup(self, stage: Optional[str] = None) -> None:
        if stage in (None, "fit") and self.train is None:
            self.train = self._tokenized("train", self.config.max_train_examples, shuffle_seed=0)
        if stage in (None, "fit", "validate") and not self.validation:
            self.validation = {s: self._by_length(self._tokenized(s, self.config.max_eval_examples))
                               for s in self.task.validation_splits}
        if stage == "predict" and not self.test:
            self.test = {s: self._by_length(self._tokenized(s, 0)) for s in self.task.test_splits}

    def train_dataloader(self) -> DataLoader:
        if self.config.group_by_length:
            sampler = LengthGroupedSampler(self.train.lengths(), self.batch_size, seed=self.seed)
        else:
            sampler = RandomSampler(self.train, generator=torch.Generator().manual_seed(self.seed))
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collator,
                          num_workers=self.config.num_workers)

    def _eval_loaders(self, datasets: dict[str, Subset]) -> list[DataLoader]:
        return [DataLoader(d, batch_size=self.config.eval_batch_size, collate_fn=self.collator,
                           num_workers=self.config.num_workers) for d in datasets.values()]

    def val_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.validation)

    def predict_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.test)

    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train) / self.batch_size)
