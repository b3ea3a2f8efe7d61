"""GLUE during pretraining: every `every_n_steps` steps, fine-tune a copy of the encoder briefly on one small task
and log its validation score as `glue/<task>/<metric>` (to the trainer's loggers, at that step), so a pretraining
run shows downstream quality as it goes.

The pretraining run is left exactly as it was: the encoder is deep-copied, the fine-tuning runs in its own
Lightning Trainer (single device, no logger, no checkpoints) on rank 0, and every random number generator
(Python, NumPy, torch CPU and CUDA) is saved before and restored after, so the pretraining run draws the same
masks and dropout with or without this callback.
"""

from __future__ import annotations

import copy
import dataclasses

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from neobert.config import LoggingConfig, TrainerConfig
from neobert.config.glue import GlueConfig, GlueDataConfig
from neobert.config.pretrain import GlueCallbackConfig
from neobert.data.backbone import Backbone
from neobert.data.glue import get_task
from neobert.data.glue_datamodule import GlueDataModule
from neobert.lit.glue import GlueClassifier, build_classifier
from neobert.lit.rng import RngState
from neobert.lit.trainer import build_trainer


class GlueEvalCallback(L.Callback):
    """Needs `pl_module.model.model` (the encoder inside NeoBERTForMaskedLM) and `pl_module.tokenizer`."""

    SEED = 0  # the same head initialisation and data order at every evaluation, so scores are comparable

    def __init__(self, config: GlueCallbackConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.task = get_task(config.task)
        self._datamodule: GlueDataModule | None = None  # tokenized once, reused at every evaluation
        self._last_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        step = trainer.global_step
        if not self.config.every_n_steps or step == 0 or step % self.config.every_n_steps or step == self._last_step:
            return  # (with gradient accumulation several batches end on the same optimizer step)
        self._last_step = step
        if trainer.is_global_zero:
            scores = {f"glue/{self.task.name}/{k}": v for k, v in self.evaluate(pl_module).items()}
            # Straight to the loggers at this step (pl_module.log from this hook would repeat the value at the
            # next logged step).
            for logger in trainer.loggers:
                logger.log_metrics(scores, step=step)
            trainer.callback_metrics.update({k: torch.tensor(v) for k, v in scores.items()})
        trainer.strategy.barrier("glue_eval_callback")

    def evaluate(self, pl_module: L.LightningModule) -> dict[str, float]:
        """Fine-tunes a copy of the encoder for `max_train_steps` and returns the validation metrics at the end."""
        rng = RngState.capture()
        try:
            torch.manual_seed(self.SEED)
            encoder = copy.deepcopy(pl_module.model.model)
            backbone = Backbone(encoder, pl_module.tokenizer, encoder.config.hidden_size,
                                encoder.config.num_hidden_layers, is_neobert=True)
            classifier = build_classifier(backbone, self.task.num_labels)
            # GLUE fine-tuning's optimizer and schedule, at this callback's learning rate.
            defaults = GlueConfig()
            module = GlueClassifier(self.task, classifier, dataclasses.replace(defaults.optimizer, lr=self.config.lr),
                                    defaults.scheduler)
            device = pl_module.device
            steps = self.config.max_train_steps
            settings = TrainerConfig(accelerator="gpu" if device.type == "cuda" else "cpu", max_steps=steps,
                                     eval_every_n_steps=steps, gradient_clip_val=1.0, precision=None)
            # An explicit single-device strategy: never joins the pretraining run's process group.
            trainer = build_trainer(settings, LoggingConfig(progress_bar=False), None,
                                    strategy=SingleDeviceStrategy(device=device))
            trainer.fit(module, datamodule=self._data(pl_module.tokenizer))
            return {k: v for k, v in module.best_scores.items() if k != "score"}
        finally:
            rng.restore()

    def _data(self, tokenizer) -> GlueDataModule:
        if self._datamodule is None:
            data = GlueDataConfig(path=self.config.data_path, max_length=self.config.max_length,
                                  batch_size=self.config.batch_size, eval_batch_size=64,
                                  max_eval_examples=self.config.max_eval_examples)
            self._datamodule = GlueDataModule(self.task, tokenizer, data, seed=self.SEED)
        return self._datamodule
