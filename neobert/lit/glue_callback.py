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
import random
import tempfile

import lightning as L
import numpy as np
import torch

from neobert.data.glue import get_task
from neobert.lit.callback_configs import GlueCallbackConfig
from neobert.lit.glue import GlueClassifier, GlueDataConfig, GlueDataModule, GlueOptimConfig, build_classifier
from neobert.model.backbone import Backbone


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class GlueEvalCallback(L.Callback):
    """Needs `pl_module.model.model` (the encoder inside NeoBERTForMaskedLM) and `pl_module.tokenizer`."""

    SEED = 0  # the same head initialisation and data order at every evaluation, so scores are comparable

    def __init__(self, config: GlueCallbackConfig):
        super().__init__()
        if config.every_n_steps < 0 or config.max_train_steps <= 0:
            raise ValueError("GlueCallbackConfig: every_n_steps must be >= 0 and max_train_steps > 0")
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
        rng = _rng_state()
        try:
            torch.manual_seed(self.SEED)
            encoder = copy.deepcopy(pl_module.model.model)
            backbone = Backbone(encoder, pl_module.tokenizer, encoder.config.hidden_size,
                                encoder.config.num_hidden_layers, is_neobert=True)
            classifier = build_classifier(backbone, self.task.num_labels)
            module = GlueClassifier(self.task, classifier, GlueOptimConfig(lr=self.config.lr))
            datamodule = self._data(pl_module.tokenizer)
            device = pl_module.device
            with tempfile.TemporaryDirectory() as scratch:
                # An explicit single-device strategy: never joins the pretraining run's process group.
                trainer = L.Trainer(
                    accelerator="gpu" if device.type == "cuda" else "cpu",
                    strategy=L.pytorch.strategies.SingleDeviceStrategy(device=device),
                    max_steps=self.config.max_train_steps,
                    precision="bf16-mixed" if device.type == "cuda" else "32-true", gradient_clip_val=1.0,
                    val_check_interval=self.config.max_train_steps, check_val_every_n_epoch=None,
                    num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=scratch)
                trainer.fit(module, datamodule=datamodule)
            return {k: v for k, v in module.best_scores.items() if k != "score"}
        finally:
            _restore_rng(rng)

    def _data(self, tokenizer) -> GlueDataModule:
        if self._datamodule is None:
            data = GlueDataConfig(path=self.config.data_path, max_length=self.config.max_length,
                                  batch_size=self.config.batch_size, eval_batch_size=64,
                                  max_eval_examples=self.config.max_eval_examples)
            self._datamodule = GlueDataModule(self.task, tokenizer, data, seed=self.SEED)
        return self._datamodule
