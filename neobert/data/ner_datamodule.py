"""The NER DataModule: one task's train and validation (dev) splits, read and tokenized once (neobert.data.ner
reads and aligns them; the layout and batching every fine-tuning task shares are `neobert.data.finetune`'s)."""

from __future__ import annotations

from typing import Optional

from torch.utils.data import DataLoader

from neobert.config.ner import NerDataConfig
from neobert.data.finetune import FineTuneDataModule
from neobert.data.ner import NerTask, TokenizedNer, example_subset, load_ner_split


class NerDataModule(FineTuneDataModule):
    """The train and validation (dev) splits of one task, each tokenized once. Scores are computed on the
    validation split."""

    def __init__(self, task: NerTask, tokenizer, config: NerDataConfig, seed: int = 0):
        super().__init__(task, tokenizer, config, seed)
        self.validation: Optional[TokenizedNer] = None

    def _tokenized(self, split: str, limit: int) -> TokenizedNer:
        sentences = example_subset(load_ner_split(self.task, split, self.config), split, limit)
        return TokenizedNer(sentences, self.task, self.tokenizer, self.max_length, f"{self.task.name}/{split}")

    def setup(self, stage: Optional[str] = None) -> None:
        if stage in (None, "fit") and self.train is None:
            self.train = self._tokenized("train", self.config.max_train_examples)
        if stage in (None, "fit", "validate") and self.validation is None:
            self.validation = self._tokenized("validation", self.config.max_eval_examples)

    def val_dataloader(self) -> DataLoader:
        return self.eval_loader(self.validation)
