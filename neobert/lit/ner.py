"""Token classification (NER) on Lightning: the token classifier on any backbone, and the LightningModule that
trains it and scores whole sentences with seqeval. The runs built from them are in `neobert.jobs.ner`.

NeoBERT backbones use `NeoBERTForTokenClassification` (exports in the hub layout, loads with
`AutoModelForTokenClassification`); any other encoder is `AutoModelForTokenClassification` of its own directory,
its own token head, exactly what a plain Hugging Face script trains.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import lightning as L
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AutoModelForTokenClassification

from neobert.config import OptimizerConfig, SchedulerConfig
from neobert.data.backbone import Backbone
from neobert.data.ner import NerTask, TokenizedNer
from neobert.eval.ner_metrics import entity_scores, word_tags
from neobert.lit import optim
from neobert.model.heads import IGNORE_INDEX
from neobert.model.modeling import NeoBERTForTokenClassification

log = logging.getLogger(__name__)


def build_token_classifier(backbone: Backbone, task: NerTask, classifier_dropout: float = 0.1) -> nn.Module:
    """A fresh token classifier for `task` from the backbone's pretrained weights (the backbone is not changed).
    Returned in train mode: `from_pretrained` leaves Hugging Face models in eval mode, and Lightning keeps each
    module's mode, which would silently switch dropout off."""
    id2label = dict(enumerate(task.labels))
    if backbone.is_neobert:
        config = dataclasses.replace(backbone.encoder.config, num_labels=len(task.labels),
                                     classifier_dropout=classifier_dropout)
        model = NeoBERTForTokenClassification(config)
        model.model = copy.deepcopy(backbone.encoder)
    else:
        model = AutoModelForTokenClassification.from_pretrained(
            backbone.source, num_labels=len(task.labels), id2label=id2label,
            label2id={v: k for k, v in id2label.items()}, classifier_dropout=classifier_dropout)
    return model.train()


class NerTagger(L.LightningModule):
    """Fine-tunes `model` (from build_token_classifier). Logs `train/loss`, `val/precision`, `val/recall`,
    `val/f1`, `val/accuracy` and `val/score` (= entity F1, which picks the best checkpoint); `best_scores` holds
    the metrics at the best step. `validation` is the tokenized dev split: its full gold tags are what is scored."""

    def __init__(self, task: NerTask, model: nn.Module, optimizer: OptimizerConfig, scheduler: SchedulerConfig,
                 validation: TokenizedNer | None = None):
        super().__init__()
        self.task, self.model, self.validation = task, model, validation
        self.optimizer_config, self.scheduler_config = optimizer, scheduler
        self.predicted: dict[int, list[int]] = {}  # sentence index -> predicted label id per sub-token
        self.best_scores: dict[str, float] = {}
        self.best_step = -1

    def forward(self, batch: dict):
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          labels=batch.get("labels"))

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self(batch).loss
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        predictions = logits.argmax(dim=-1).masked_fill(batch["labels"] == IGNORE_INDEX, -1).cpu()
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        for row, (i, n) in enumerate(zip(batch["idx"].tolist(), lengths)):
            self.predicted[i] = predictions[row, :n].tolist()

    def on_validation_epoch_end(self) -> None:
        predicted = self.predicted
        self.predicted = {}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, predicted)
            predicted = {k: v for part in gathered for k, v in part.items()}
        scores = self.score(predicted, partial=self.trainer.sanity_checking)
        for name, value in scores.items():
            self.log(f"val/{name}", value, sync_dist=True)
        self.log("val/score", scores["f1"], prog_bar=True, sync_dist=True)
        if not self.trainer.sanity_checking and (not self.best_scores or scores["f1"] > self.best_scores["score"]):
            self.best_scores = {**scores, "score": scores["f1"]}
            self.best_step = self.global_step

    def score(self, predicted: dict[int, list[int]], partial: bool = False) -> dict[str, float]:
        """Entity scores of the predicted sentences against their full gold tags. Every validation sentence must
        have a prediction, except in Lightning's sanity check (`partial`: the sentences it saw)."""
        indices = sorted(predicted) if partial else range(len(self.validation))
        missing = [i for i in indices if i not in predicted]
        if missing:
            raise RuntimeError(f"no prediction for {len(missing)} validation sentences (first {missing[:5]})")
        gold = [self.validation.tags[i] for i in indices]
        tags = [word_tags(len(self.validation.tags[i]), self.validation.word_positions[i], predicted[i],
                          self.task.labels) for i in indices]
        return entity_scores(gold, tags)

    def configure_optimizers(self):
        total = max(1, int(self.trainer.estimated_stepping_batches))
        return optim.configure_optimizers(self.model, self.optimizer_config, self.scheduler_config, total)

