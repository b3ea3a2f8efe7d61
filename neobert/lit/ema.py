"""An exponential moving average (EMA) of the weights during training (`trainer.ema`), as a Lightning callback.

Lightning's own `WeightAveraging` callback puts the averaged weights in place of the trained ones during
validation, in every checkpoint's `state_dict` and in the model at the end of training. We want both weight sets
side by side instead: the raw weights stay the model's (what resume, export and the paper's recipe use), the
average is validated beside them (`val/loss_ema`), kept in every checkpoint under `EMA_STATE_KEY` and exported
as an alternative weight set (`export/ema`).
"""

from __future__ import annotations

import contextlib

import lightning as L
import torch

from neobert.lit.checkpoints import EMA_STATE_KEY
from neobert.lit.strategies import master_state_dict


class ExponentialMovingAverage(L.Callback):
    """ema = decay x ema + (1 - decay) x weights, after every `every_n_steps`-th optimizer step, in float32, over
    every floating-point entry of the LightningModule's state dict (same keys as a checkpoint's `state_dict`)."""

    def __init__(self, decay: float, every_n_steps: int = 1):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay, self.every_n_steps = decay, every_n_steps
        self.weights: dict[str, torch.Tensor] | None = None
        self.last_update_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.weights is None:  # a new run, or a checkpoint written without EMA: start from the weights
            self.weights = {name: value.detach().float().clone() for name, value in self._master(trainer, pl_module).items()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        step = trainer.global_step  # optimizer steps taken; unchanged between the micro-batches of one step
        if step == self.last_update_step or step % self.every_n_steps:
            return
        current = self._master(trainer, pl_module)
        averages = list(self.weights.values())
        torch._foreach_lerp_(averages, [current[name].detach().float() for name in self.weights], 1 - self.decay)
        self.last_update_step = step

    @staticmethod
    def _master(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
        """The weights the average follows: the fp32 master weights (under DeepSpeed bf16 the module's parameters
        are bf16 copies; gathering the masters is a collective, so under DeepSpeed raise every_n_steps)."""
        state = master_state_dict(pl_module, trainer.strategy)
        return {name: value for name, value in state.items() if value.is_floating_point()}

    @staticmethod
    def _floating(pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
        return {name: value for name, value in pl_module.state_dict().items() if value.is_floating_point()}

    # --------------------------------------------------------------------------------- validation with the EMA
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        """`val/loss_ema` beside `val/loss`, for modules that say how to score a validation batch
        (`validation_loss(batch) -> (loss, weight)`, e.g. the MLM loss and its number of masked tokens)."""
        if self.weights is None or not hasattr(pl_module, "validation_loss"):
            return
        with torch.no_grad(), self.swapped_in(pl_module):
            loss, weight = pl_module.validation_loss(batch)
        pl_module.log("val/loss_ema", loss, on_epoch=True, sync_dist=True, batch_size=max(1, weight))

    @contextlib.contextmanager
    def swapped_in(self, pl_module: L.LightningModule):
        """The EMA weights in the module for the duration, the trained ones back after (also on an error)."""
        current = self._floating(pl_module)
        names = list(self.weights)
        trained = [current[name].detach().clone() for name in names]
        torch._foreach_copy_([current[name] for name in names], [self.weights[name] for name in names])
        try:
            yield
        finally:
            torch._foreach_copy_([current[name] for name in names], trained)

    # --------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {"last_update_step": self.last_update_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_update_step = state_dict["last_update_step"]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.weights is not None:
            checkpoint[EMA_STATE_KEY] = {name: w.clone() for name, w in self.weights.items()}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        saved = checkpoint.get(EMA_STATE_KEY)
        if saved is not None:
            device = pl_module.device
            self.weights = {name: w.float().to(device) for name, w in saved.items()}
