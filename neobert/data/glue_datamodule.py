"""The GLUE DataModule: one task's splits, tokenized once (neobert.data.glue reads and tokenizes them; the layout
and batching every fine-tuning task shares are `neobert.data.finetune`'s)."""

from __future__ import annotations

from typing import Optional

from torch.utils.data import DataLoader

from neobert.config.glue import GlueDataConfig
from neobert.data.finetune import FineTuneDataModule
from neobert.data.glue import GlueTask, TokenizedGlue, load_glue_split


class GlueDataModule(FineTuneDataModule):
    """Train and validation splits (and test splits for prediction) of one task, each tokenized once."""

    def __init__(self, task: GlueTask, tokenizer, config: GlueDataConfig, seed: int = 0):
        super().__init__(task, tokenizer, config, seed)
        self.validation: dict[str, TokenizedGlue] = {}
        self.test: dict[str, TokenizedGlue] = {}

    def _tokenized(self, split: str, limit: int, shuffle_seed: Optional[int] = None) -> TokenizedGlue:
        dataset = load_glue_split(self.task, split, self.config.path)
        if limit and limit < len(dataset):
            dataset = (dataset.shuffle(seed=shuffle_seed) if shuffle_seed is not None else dataset).select(range(limit))
        return TokenizedGlue(self.task, split, dataset, self.tokenizer, self.max_length)

    def setup(self, stage: Optional[str] = None) -> None:
        if stage in (None, "fit") and self.train is None:
            self.train = self._tokenized("train", self.config.max_train_examples, shuffle_seed=0)
        if stage in (None, "fit", "validate") and not self.validation:
            self.validation = {s: self._tokenized(s, self.config.max_eval_examples)
                               for s in self.task.validation_splits}
        if stage == "predict" and not self.test:
            self.test = {s: self._tokenized(s, 0) for s in self.task.test_splits}

    def val_dataloader(self) -> list[DataLoader]:
        return [self.eval_loader(split) for split in self.validation.values()]

    def predict_dataloader(self) -> list[DataLoader]:
        return [self.eval_loader(split) for split in self.test.values()]
