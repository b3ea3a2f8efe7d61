"""The masked-language-model pretraining LightningModule: loss, accuracy, throughput and MFU logging, FSDP2
sharding, the optimizer and schedule, and what a checkpoint carries besides the weights (model config,
tokenizer, run config). The whole job is `neobert.jobs.pretrain.run_pretraining`.
"""

from __future__ import annotations

import math
import time

import lightning as L
import torch
from omegaconf import OmegaConf
from torch.distributed.fsdp import fully_shard

from neobert.config.pretrain import PretrainConfig
from neobert.data.pretraining import DATA_STATE_KEY
from neobert.eval.flops import flops_per_token, matmul_params, mfu, peak_flops
from neobert.lit.checkpoints import CHECKPOINT_KEY
from neobert.lit.optim import configure_optimizers
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite: the run stops on that step, before the optimizer step and
    before any checkpoint is written over the last good one (ModelCheckpoint's save_on_exception is off)."""


def describe_data_position(data_state: dict | None) -> str:
    """Where a training batch came from, from the data state it carries (`batch[DATA_STATE_KEY]`)."""
    if data_state is None:
        return "the batch carries no data position"
    state = data_state["state"]
    return (f"the batch came from data stream {data_state['stream']} (the stream's batch {state['batches']}, "
            f"ending at epoch {state['epoch']}, shuffle block {state['block']}, document {state['taken']} of the "
            f"block)")


class MLMPretrainingModule(L.LightningModule):
    """`.model` is the NeoBERTForMaskedLM, `.tokenizer` its tokenizer (the evaluation callbacks use both)."""

    def __init__(self, config: PretrainConfig, model_config: NeoBERTConfig, tokenizer):
        super().__init__()
        self.config = config
        self.model = NeoBERTForMaskedLM(model_config)
        self.tokenizer = tokenizer
        self.masked_only = config.model.masked_only_logits
        self._sums = self._empty_sums()
        self._step_started: float | None = None
        self.start_step = 0  # where a wsd decay branch starts (the job sets it from branch_from)
        # Training FLOPs per token; the decoder only runs at masked positions with masked-only logits.
        weights = matmul_params(self.model)
        if self.masked_only:
            weights -= (1 - config.masking.rate) * self.model.decoder.weight.numel()
        self.flops_per_token = flops_per_token(weights, model_config.num_hidden_layers, model_config.hidden_size,
                                               config.data.max_length, training=True)

    def configure_model(self) -> None:
        # FSDP2 (trainer.strategy=fsdp2): shard every block, then the rest.
        if getattr(self, "device_mesh", None) is not None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.model.transformer_encoder:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        if self.config.model.compile:
            self.model.compile()

    def forward(self, batch: dict):
        encoder_kwargs = {}
        if "cu_seqlens" in batch:
            encoder_kwargs = {"cu_seqlens": batch["cu_seqlens"], "max_seqlen": batch["max_seqlen"]}
        return self.model(batch["input_ids"], batch.get("attention_mask"), labels=batch["labels"],
                          masked_only=self.masked_only, **encoder_kwargs)

    @staticmethod
    def _accuracy_counts(output, labels: torch.Tensor) -> tuple[int, int]:
        if output.masked_positions is not None:
            targets = labels[output.masked_positions]
            logits = output.logits
        else:
            positions = labels != -100
            targets, logits = labels[positions], output.logits[positions]
        return int((logits.argmax(-1) == targets).sum()), int(targets.numel())

    def training_step(self, batch: dict, batch_idx: int):
        data_state = batch.pop(DATA_STATE_KEY, None)
        if data_state is not None and self.trainer.datamodule is not None:
            self.trainer.datamodule.record(data_state)  # the data position of the next checkpoint
        output = self(batch)
        correct, masked = self._accuracy_counts(output, batch["labels"])
        tokens = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        loss = float(output.loss.detach())
        accumulate = self.trainer.accumulate_grad_batches
        if not math.isfinite(loss):
            micro = f", micro-batch {batch_idx % accumulate + 1} of {accumulate}" if accumulate > 1 else ""
            raise NonFiniteLossError(
                f"the training loss is {loss} at global step {self.trainer.global_step}{micro}: "
                f"{describe_data_position(data_state)}. Training stopped before this step's update; nothing was "
                f"saved over the last checkpoint (resume=true restarts from it)")
        self._sums["loss"] += loss
        self._sums["correct"] += correct
        self._sums["masked"] += masked
        self._sums["tokens"] += tokens
        stats = (data_state or {}).get("stats")
        if stats is not None:  # what the data schedule and the packer did (neobert.data.pretraining.BatchBuilder)
            self._sums["sequences"] += stats["rows"]
            self._sums["capacity"] += stats["rows"] * self.config.data.max_length
            self._sums["mask_rate"] = stats["mask_rate"]
        if (batch_idx + 1) % accumulate == 0:  # the last micro-batch of an optimizer step: log step means
            self._log_step(accumulate)
        return output.loss

    @staticmethod
    def _empty_sums() -> dict:
        return {"loss": 0.0, "correct": 0, "masked": 0, "tokens": 0, "sequences": 0, "capacity": 0, "mask_rate": None}

    def _log_step(self, accumulate: int) -> None:
        sums, world = self._sums, self.trainer.world_size
        metrics = {
            "train/loss": sums["loss"] / accumulate,
            "train/accuracy": sums["correct"] / max(1, sums["masked"]),
            "train/lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            "train/tokens": float(sums["tokens"] * world),
        }
        if sums["capacity"]:
            metrics["train/batch_size"] = float(sums["sequences"] * world)  # sequences (packed rows) per step
            metrics["train/packing_efficiency"] = sums["tokens"] / sums["capacity"]  # real tokens / row capacity
            metrics["train/mask_rate"] = sums["mask_rate"]
        now = time.perf_counter()
        if self._step_started is not None:
            tokens_per_second = sums["tokens"] * world / (now - self._step_started)
            metrics["train/tokens_per_sec"] = tokens_per_second
            peak = peak_flops(self.device)
            if peak:
                metrics["train/mfu"] = mfu(tokens_per_second / world, self.flops_per_token, peak)
        self._step_started = now
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        self.log("loss", metrics["train/loss"], prog_bar=True, on_step=True, on_epoch=False, logger=False)
        self._sums = self._empty_sums()

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:  # (DeepSpeed keeps its partitioned gradients elsewhere)
            norm = torch.nn.utils.get_total_norm(grads)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            self.log("train/grad_norm", norm, on_step=True, on_epoch=False, batch_size=1)

    def validation_step(self, batch: dict, batch_idx: int):
        output = self(batch)
        correct, masked = self._accuracy_counts(output, batch["labels"])
        self.log("val/loss", output.loss, on_epoch=True, sync_dist=True, batch_size=max(1, masked), prog_bar=True)
        self.log("val/accuracy", correct / max(1, masked), on_epoch=True, sync_dist=True, batch_size=max(1, masked))

    def validation_loss(self, batch: dict) -> tuple[torch.Tensor, int]:
        """The MLM loss of a validation batch and its weight (masked tokens); the EMA callback scores its weights
        with it."""
        return self(batch).loss, int((batch["labels"] != -100).sum())

    def configure_optimizers(self):
        # The schedule length is trainer.max_steps; reading trainer.estimated_stepping_batches here would
        # make Lightning build the dataloader early and drop its restored state.
        return configure_optimizers(self.model, self.config.optimizer, self.config.scheduler,
                                    self.config.trainer.max_steps, self.start_step)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "model_config": self.model.config.to_hub_dict(),
            "tokenizer": self.config.data.tokenizer,
            "config": OmegaConf.to_container(OmegaConf.structured(self.config)),
        }
