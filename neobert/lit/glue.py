"""GLUE fine-tuning on Lightning (paper Table 3 and the fine-tuning appendix): the paper's head on any backbone,
and the LightningModule that trains and evaluates it. The runs built from them are in `neobert.jobs.glue`.

The same optimizer (AdamW, betas (0.9, 0.95)), schedule (6% warm-up, then linear decay) and head
([CLS] -> dropout -> dense -> tanh -> dropout -> classifier) for every backbone, so NeoBERT and any Hugging Face
encoder are compared under identical conditions. NeoBERT backbones use `NeoBERTForSequenceClassification`, so
the fine-tuned model exports in the hub layout.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import lightning as L
from torch import Tensor, nn

from neobert.config import OptimizerConfig, SchedulerConfig
from neobert.data.backbone import Backbone
from neobert.data.glue import GlueTask
from neobert.eval.glue_metrics import GlueMetrics, main_score_key, predictions
from neobert.layout import WEIGHTS_NAME
from neobert.lit import optim
from neobert.model.checkpoint import load_state_dict_strict, read_weights
from neobert.model.heads import ClassificationHead, SequenceClassifierOutput
from neobert.model.modeling import NeoBERTForSequenceClassification

log = logging.getLogger(__name__)

TRANSFER_HEAD_PREFIX = "classifier."  # re-initialised on transfer: the label sets differ (MNLI has 3 labels)


class BackboneForSequenceClassification(ClassificationHead, nn.Module):
    """The paper's head on any Hugging Face encoder, with the same layer names as NeoBERT's classifier."""

    def __init__(self, backbone: Backbone, num_labels: int, classifier_dropout: float = 0.1,
                 init_range: float = 0.02):
        super().__init__()
        self.backbone = backbone
        self.add_classification_head(backbone.hidden_size, num_labels, classifier_dropout, init_range)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> SequenceClassifierOutput:
        # Pair tasks: BERT-style encoders were pretrained with segment embeddings, so they get them.
        return self.classify(self.backbone(input_ids, attention_mask, token_type_ids), labels)


def build_classifier(backbone: Backbone, num_labels: int, classifier_dropout: float = 0.1) -> nn.Module:
    """NeoBERT backbones -> NeoBERTForSequenceClassification (exports in the hub layout); others -> the same head
    on the Hugging Face encoder. The encoder is reused, not copied. Returned in train mode: `from_pretrained`
    leaves Hugging Face models in eval mode, and Lightning keeps each module's mode, which would silently
    switch dropout off for the encoder."""
    if backbone.is_neobert:
        config = dataclasses.replace(backbone.encoder.config, num_labels=num_labels,
                                     classifier_dropout=classifier_dropout)
        model = NeoBERTForSequenceClassification(config)
        model.model = backbone.encoder
    else:
        model = BackboneForSequenceClassification(backbone, num_labels, classifier_dropout)
    return model.train()


def model_inputs(batch: dict, model: nn.Module) -> dict:
    """The batch keys `model` takes: token_type_ids for Hugging Face encoders only (NeoBERT has no segments)."""
    keys = ["input_ids", "attention_mask"]
    if isinstance(model, BackboneForSequenceClassification) and "token_type_ids" in batch:
        keys.append("token_type_ids")
    return {k: batch[k] for k in keys}


def load_transfer_weights(model: nn.Module, directory: str | Path) -> None:
    """Loads a fine-tuned model (e.g. MNLI) into `model`: everything but the classifier layer, which stays freshly
    initialised because the label sets differ. Any other mismatch means a different backbone: an error."""
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"transfer_from: {path} does not exist. Fine-tune that task first with the same model and output_dir "
            f"(it keeps its best model in <output_dir>/<task>/best/), or set transfer_from=null")
    state = read_weights(path)
    if not any(k.startswith("dense.") for k in state):  # the head's dense layer is part of what transfers
        raise ValueError(f"transfer_from: {path} has no fine-tuned head (dense.*): it is not a model fine-tuned "
                         f"from this backbone")
    try:
        load_state_dict_strict(model, state, source=str(path), keep_fresh=(TRANSFER_HEAD_PREFIX,))
    except ValueError as err:
        raise ValueError(f"transfer_from: {path} was not fine-tuned from this backbone ({err})") from err
    log.info("transferred all but the classifier layer from %s", path)


class GlueClassifier(L.LightningModule):
    """Fine-tunes `model` (from build_classifier) on one task. Logs `train/loss`, `val/<metric>` and `val/score`
    (the task's main metric, which picks the best checkpoint); `best_scores` holds the metrics at the best step."""

    def __init__(self, task: GlueTask, model: nn.Module, optimizer: OptimizerConfig, scheduler: SchedulerConfig):
        super().__init__()
        self.task, self.model = task, model
        self.optimizer_config, self.scheduler_config = optimizer, scheduler
        self.metrics = GlueMetrics(task)
        self.best_scores: dict[str, float] = {}
        self.best_step = -1

    def forward(self, batch: dict) -> SequenceClassifierOutput:
        return self.model(**model_inputs(batch, self.model), labels=batch.get("labels"))

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self(batch).loss
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        logits = self.model(**model_inputs(batch, self.model)).logits
        self.metrics.update(self.task.validation_splits[dataloader_idx], logits, batch["labels"])

    def on_validation_epoch_end(self) -> None:
        scores = self.metrics.compute()
        self.metrics.reset()
        score = scores[main_score_key(self.task)]
        for name, value in scores.items():
            self.log(f"val/{name}", value, sync_dist=True)
        self.log("val/score", score, prog_bar=True, sync_dist=True)
        if not self.trainer.sanity_checking and (not self.best_scores or score > self.best_scores["score"]):
            self.best_scores = {**scores, "score": score}
            self.best_step = self.global_step

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> dict:
        logits = self.model(**model_inputs(batch, self.model)).logits
        return {"idx": batch["idx"], "prediction": predictions(self.task, logits)}

    def configure_optimizers(self):
        total = max(1, int(self.trainer.estimated_stepping_batches))
        return optim.configure_optimizers(self.model, self.optimizer_config, self.scheduler_config, total)
