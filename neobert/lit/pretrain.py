"""The masked-language-model pretraining LightningModule: loss, accuracy, throughput and MFU logging, FSDP2
sharding, the optimizer and schedule, and what a checkpoint carries besides the weights (model config,
tokenizer, run config). The whole job is `neobert.jobs.pretrain.run_pretraining`.
"""

from __future__ import annotations

import logging
import time

import lightning as L
import torch
from omegaconf import OmegaConf

from neobert.config.pretrain import CUDA_GRAPH_MODES, PretrainConfig
from neobert.data.pretraining import SOURCE_KEY
from neobert.data.stream_state import DATA_STATE_KEY
from neobert.eval.flops import attention_flops, flops_per_token, matmul_params, mfu, peak_flops
from neobert.lit.checkpoints import CHECKPOINT_KEY
from neobert.lit.optim import configure_optimizers, lr_factor
from neobert.lit.strategies import deepspeed_grad_norm, fsdp2_shard, is_deepspeed, loop_compute_dtype
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model.heads import IGNORE_INDEX

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite. The loss stays on the device during the step loop; the module
    looks at it when it reads its metrics (every logging.log_every_n_steps steps), before any checkpoint is
    written and at the end of training, and then stops the run naming the first bad step: nothing is saved over
    the last good checkpoint (ModelCheckpoint's save_on_exception is off)."""


def describe_data_position(data_state: dict | None) -> str:
    """Where a training batch came from, from the data state it carries (`batch[DATA_STATE_KEY]`): the position kept
    beside its encoded stream state (`neobert.data.stream_state.EncodedStreamState`), nothing decoded."""
    if data_state is None:
        return "the batch carries no data position"
    state = data_state["state"]
    return (f"the batch came from data stream {data_state['stream']} (the stream's batch {state.batches}, "
            f"ending at epoch {state.epoch}, shuffle block {state.block}, document {state.taken} of the block)")


def real_tokens(batch: dict, stats: dict | None) -> int | torch.Tensor:
    """The real tokens of a training batch, read from nothing on the device: counted on the host where the batch was
    built (`stats`, its stream's: [PAD] not counted), else its attention mask's sum (a device tensor, summed where it
    is read) or, without a mask, its token slots."""
    if stats is not None:
        return stats["tokens"]
    return batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()


class MLMPretrainingModule(L.LightningModule):
    """`.model` is the NeoBERTForMaskedLM, `.tokenizer` its tokenizer (the evaluation callbacks use both)."""

    def __init__(self, config: PretrainConfig, model_config: NeoBERTConfig, tokenizer):
        super().__init__()
        if not isinstance(config.model.compile, bool):  # "auto" is truthy: never taken for true here
            raise ValueError(f"model.compile={config.model.compile!r}: the run decides auto for its device before it "
                             f"builds the module (neobert.jobs.pretrain.decide_compile)")
        self.config = config
        self.model = NeoBERTForMaskedLM(model_config)
        self.tokenizer = tokenizer
        self.masked_only = config.model.masked_only_logits
        # The step loop reads nothing back from the device (a GPU would wait for the host at every read): the
        # forward skips its input checks, and the metrics and the loss's finiteness are kept on the device and
        # read every logging.log_every_n_steps steps (`_read_metrics`).
        self.model.set_validate_inputs(False)
        self._step = self._empty_step()
        self._interval_tokens: torch.Tensor | float = 0.0
        self._interval_started: float | None = None
        # (step, micro-batch, where its batch came from) of every micro-batch since the last read
        self._micro_batches: list[tuple[int, int, str]] = []
        self._first_nonfinite: torch.Tensor | None = None  # index into _micro_batches, -1 while all were finite
        self._first_nonfinite_loss: torch.Tensor | None = None
        self.start_step = 0  # where a wsd decay branch starts (the job sets it from branch_from, or a decay phase)
        # The lr schedule: its length and its first global step (a phase of a phased recipe: its schedule segment)
        self.schedule_steps, self.schedule_first_step = config.trainer.max_steps, 0
        self.phase_start: int | None = None  # a phase's first step: restored from there, it takes its own peak lr
        self.progress_bar_values: dict[str, float] = {}
        # Training FLOPs (train/mfu): the matmuls per token (the decoder only at masked positions with masked-only
        # logits), plus attention from the real sequence lengths, the batches' sum of squared lengths (their stats).
        weights = matmul_params(self.model)
        if self.masked_only:
            weights -= (1 - config.masking.rate) * self.model.decoder.weight.numel()
        self.matmul_flops_per_token = flops_per_token(weights, model_config.num_hidden_layers,
                                                      model_config.hidden_size, 0, training=True)
        self.attention_flops_per_squared_length = attention_flops(model_config.num_hidden_layers,
                                                                  model_config.hidden_size, 1, training=True)
        self._interval_squared_lengths = 0  # a host count: sum of squared sequence lengths since the last read
        # The wall time of the run's first optimizer step (compilation included where compiled): when it started,
        # then its seconds, logged as train/first_step_s with the next metrics
        self._first_step_started: float | None = None
        self.first_step_s: float | None = None
        self._first_step_logged = False

    def training_flops_per_token(self, tokens: float, squared_lengths: float) -> float:
        """train/mfu's FLOPs per token of `tokens` trained tokens whose sequences' squared lengths sum to
        `squared_lengths`: the matmuls, plus attention at the real lengths."""
        return self.matmul_flops_per_token + self.attention_flops_per_squared_length * squared_lengths / tokens

    def configure_model(self) -> None:
        if getattr(self, "device_mesh", None) is not None:  # FSDP2 (trainer.strategy=fsdp2)
            fsdp2_shard(self.model, self.model.model.transformer_encoder, self.device_mesh["data_parallel"],
                        self.trainer.precision)
        if self.config.model.compile:
            self.model.compile(mode=self.config.model.compile_mode, scope=self.config.model.compile_scope)

    def forward(self, batch: dict):
        if self.config.model.compile_mode in CUDA_GRAPH_MODES:
            # Every call is a new step of the CUDA graphs: they may reuse the memory of the previous call's outputs,
            # which the step has read (the metrics are new tensors, and its backward ran).
            torch.compiler.cudagraph_mark_step_begin()
        encoder_kwargs = {}
        if "cu_seqlens" in batch:
            encoder_kwargs = {"cu_seqlens": self._real_documents(batch), "max_seqlen": batch["max_seqlen"]}
        masked = {}
        if self.masked_only:  # the collator's index (no search on the device), or a search for batches without one
            masked = {"masked_index": batch["masked_index"]} if "masked_index" in batch else {"masked_only": True}
        return self.model(batch["input_ids"], batch.get("attention_mask"), labels=batch["labels"], **masked,
                          **encoder_kwargs)

    def _real_documents(self, batch: dict) -> torch.Tensor:
        """cu_seqlens without a static batch's zero-length filler documents (neobert.data.masking.StaticShapes: the
        batch's "documents" counts those before them, [PAD] tails included), which only CUDA graphs need (they replay
        fixed shapes); each would cost the attention kernel a block per head. A compiled model takes the count as a
        dynamic size: one graph for every count."""
        cu_seqlens = batch["cu_seqlens"]
        if "documents" in batch and self.config.model.compile_mode not in CUDA_GRAPH_MODES:
            cu_seqlens = cu_seqlens[: batch["documents"] + 1]
            if self.config.model.compile:
                torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        return cu_seqlens

    @staticmethod
    def _accuracy_counts(output, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | int]:
        """(correct, masked) predictions: a device tensor, and the count as a device tensor or, where the masked
        positions were selected, a Python int (their number is the selection's shape, known on the host: a tensor
        made of it would be a host-to-device copy every micro-batch). Nothing is read back. A static packed batch's
        masked_index is padded to a fixed length with a position labelled -100 (neobert.data.masking.StaticShapes):
        only the targets that are not -100 count."""
        if output.masked_index is not None:
            targets = labels.reshape(-1).index_select(0, output.masked_index)
            scored = targets != IGNORE_INDEX
            return ((output.predicted_ids() == targets) & scored).sum(), scored.sum()
        if output.masked_positions is not None:
            targets = labels[output.masked_positions]
            return (output.predicted_ids() == targets).sum(), targets.numel()
        scored = labels != IGNORE_INDEX
        return ((output.predicted_ids() == labels) & scored).sum(), scored.sum()

    def training_step(self, batch: dict, batch_idx: int):
        data_state = batch.pop(DATA_STATE_KEY, None)
        if data_state is not None and self.trainer.datamodule is not None:
            self.trainer.datamodule.record(data_state)  # the data position of the next checkpoint
        output = self(batch)
        loss = output.loss.detach()
        accumulate = self.trainer.accumulate_grad_batches
        self._track_finite(loss, batch_idx % accumulate + 1, data_state)
        correct, masked = self._accuracy_counts(output, batch["labels"])
        stats = (data_state or {}).get("stats")
        tokens = real_tokens(batch, stats)
        step = self._step
        step["loss"] = step["loss"] + loss
        step["correct"] = step["correct"] + correct
        step["masked"] = step["masked"] + masked
        step["tokens"] = step["tokens"] + tokens
        self._interval_tokens = self._interval_tokens + tokens
        if stats is not None:  # what the data schedule and the packer did (neobert.data.pretraining.BatchBuilder)
            step["sequences"] += stats["rows"]
            step["capacity"] += stats["rows"] * self.config.data.max_length
            step["mask_rate"] = stats["mask_rate"]
            self._interval_squared_lengths += stats["squared_lengths"]  # attention FLOPs at the real lengths
        else:  # a batch without the stream's stats: its shape bounds sum(n_i^2) by tokens x longest (no device read)
            longest = batch["max_seqlen"] if "cu_seqlens" in batch else batch["input_ids"].shape[-1]
            self._interval_squared_lengths += batch["input_ids"].numel() * int(longest)
        if (batch_idx + 1) % accumulate == 0:  # the last micro-batch of an optimizer step
            # The steps Lightning writes its logs at (its interval can be shorter than logging.log_every_n_steps).
            if (self.trainer.global_step + 1) % self.trainer.log_every_n_steps == 0:
                self._read_metrics(accumulate)
            self._step = self._empty_step()
        return output.loss

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # The logged step is the optimizer step. Lightning logs at its own count of steps taken
        # (epoch_loop._batches_that_stepped); restored from a checkpoint saved after its step had completed (a
        # phase's final checkpoint) at a step that validates, it spends its first loop iteration skipping that
        # validation and counts it as a step: every such phase boundary skipped a logged step, and the last phase
        # logged past trainer.max_steps (Lightning 2.6).
        loop = self.trainer.fit_loop.epoch_loop
        if loop._batches_that_stepped != self.trainer.global_step:
            loop._batches_that_stepped = self.trainer.global_step
        if self._first_step_started is None:
            self._first_step_started = time.perf_counter()

    @staticmethod
    def _empty_step() -> dict:
        return {"loss": 0.0, "correct": 0, "masked": 0, "tokens": 0, "sequences": 0, "capacity": 0, "mask_rate": None}

    # ------------------------------------------------------------------ NaN / inf, checked without a host read
    def _track_finite(self, loss: torch.Tensor, micro_batch: int, data_state: dict | None) -> None:
        """Remembers, on the device, the first micro-batch since the last read whose loss was not finite."""
        self._micro_batches.append((self.trainer.global_step, micro_batch, describe_data_position(data_state)))
        if self._first_nonfinite is None:
            self._first_nonfinite = torch.full((), -1, dtype=torch.long, device=loss.device)
            self._first_nonfinite_loss = torch.zeros((), dtype=loss.dtype, device=loss.device)
        first_bad = (self._first_nonfinite < 0) & ~torch.isfinite(loss)
        index = torch.full((), len(self._micro_batches) - 1, dtype=torch.long, device=loss.device)
        self._first_nonfinite = torch.where(first_bad, index, self._first_nonfinite)
        self._first_nonfinite_loss = torch.where(first_bad, loss, self._first_nonfinite_loss)

    def check_finite(self, stopping: str) -> None:
        """Raises NonFiniteLossError if a training loss since the last check was NaN or infinite (one host read);
        `stopping` says what the error stops (e.g. "before the update of global step 5")."""
        if self._first_nonfinite is None:
            return
        first = int(self._first_nonfinite)
        if first >= 0:
            step, micro_batch, position = self._micro_batches[first]
            accumulate = self.trainer.accumulate_grad_batches
            micro = f", micro-batch {micro_batch} of {accumulate}" if accumulate > 1 else ""
            raise NonFiniteLossError(
                f"the training loss is {float(self._first_nonfinite_loss)} at global step {step}{micro}: "
                f"{position}. Training stopped {stopping} (the loss is checked every "
                f"{self.trainer.log_every_n_steps} steps, logging.log_every_n_steps, and before every checkpoint); "
                f"nothing was saved after the last good checkpoint (resume=true restarts from it)")
        self._micro_batches.clear()

    def on_train_end(self) -> None:
        self.check_finite("at the end of training, before the export")

    # ------------------------------------------------------------------ metrics, read every log interval
    def _read_metrics(self, accumulate: int) -> None:
        self.check_finite(f"before the update of global step {self.trainer.global_step}")
        step, world = self._step, self.trainer.world_size
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in (
            step["loss"], step["correct"], step["masked"], step["tokens"], self._interval_tokens)])
        if world > 1:  # the global batch's figures, whatever the layout (every rank reads at the same step)
            values = self.trainer.strategy.reduce(values, reduce_op="sum")
        loss, correct, masked, tokens, interval_tokens = values.tolist()
        metrics = {
            "train/loss": loss / (accumulate * world),
            "train/accuracy": correct / max(1.0, masked),
            "train/lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            "train/tokens": tokens,
        }
        if step["capacity"]:
            metrics["train/batch_size"] = float(step["sequences"] * world)  # sequences (packed rows) per step
            metrics["train/packing_efficiency"] = tokens / (step["capacity"] * world)  # real tokens / row capacity
            metrics["train/mask_rate"] = step["mask_rate"]
        datamodule = self.trainer.datamodule
        if self.config.data.sources and datamodule is not None:  # a mixture: what each source has given so far
            counts = datamodule.source_counts()  # host counts in the streams' trained positions
            documents = sum(counts["documents"].values())
            for name, count in counts["tokens"].items():
                metrics[f"train/tokens/{name}"] = float(count * world)
                # the realised share of the draws, in the unit of the targets (documents)
                metrics[f"train/share/{name}"] = counts["documents"][name] / documents if documents else 0.0
        now = time.perf_counter()  # the read above waited for the device: the interval's time is real
        if self._interval_started is not None:
            tokens_per_second = interval_tokens / (now - self._interval_started)
            metrics["train/tokens_per_sec"] = tokens_per_second
            peak = peak_flops(self.device, loop_compute_dtype(self.config.trainer.strategy, self.trainer.precision))
            if peak and interval_tokens:
                per_token = self.training_flops_per_token(interval_tokens / world, self._interval_squared_lengths)
                metrics["train/mfu"] = mfu(tokens_per_second / world, per_token, peak)
        if self.first_step_s is not None and not self._first_step_logged:
            metrics["train/first_step_s"], self._first_step_logged = self.first_step_s, True
        self._interval_started, self._interval_tokens, self._interval_squared_lengths = now, 0.0, 0
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        # Shown by the progress bar as a Python number: a value logged with prog_bar=True would be read back from
        # the device by Lightning after every batch (neobert.lit.trainer.ProgressBar).
        self.progress_bar_values = {"loss": metrics["train/loss"]}

    def on_before_optimizer_step(self, optimizer) -> None:
        if is_deepspeed(self.trainer.strategy):
            return  # called every micro-batch there, with ZeRO's gradients elsewhere: see on_train_batch_end
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            self.log("train/grad_norm", norm, on_step=True, on_epoch=False, batch_size=1)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            norm = deepspeed_grad_norm(self.trainer.strategy)  # the step's norm, from DeepSpeed's engine
            if norm is not None:
                self.log("train/grad_norm", norm, on_step=True, on_epoch=False, batch_size=1)
            if self.first_step_s is None:
                self._time_first_step()

    def _time_first_step(self) -> None:
        """The first optimizer step's wall time, once the device has finished it (the run's one extra wait)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.first_step_s = time.perf_counter() - self._first_step_started
        if self.trainer.is_global_zero:
            scope = self.config.model.compile_scope
            how = f"torch.compile's compilation ({scope}) included" if self.config.model.compile else "eager"
            log.info("the first optimizer step took %.1f s (%s): train/first_step_s", self.first_step_s, how)

    def validation_step(self, batch: dict, batch_idx: int):
        output = self(batch)
        correct, masked = self._accuracy_counts(output, batch["labels"])
        masked = max(1, int(masked))  # the epoch mean's weight (validation is not the step loop)
        self.log("val/loss", output.loss, on_epoch=True, sync_dist=True, batch_size=masked, prog_bar=True)
        if SOURCE_KEY in batch:  # a mixture: every rank validates every source (PretrainingDataModule.deal)
            self.log(f"val/loss/{batch[SOURCE_KEY]}", output.loss, on_epoch=True, sync_dist=True, batch_size=masked)
        self.log("val/accuracy", correct / masked, on_epoch=True, sync_dist=True, batch_size=masked)

    def validation_loss(self, batch: dict) -> tuple[torch.Tensor, int]:
        """The MLM loss of a validation batch and its weight (masked tokens); the EMA callback scores its weights
        with it."""
        return self(batch).loss, int((batch["labels"] != IGNORE_INDEX).sum())

    def configure_optimizers(self):
        # The schedule length is trainer.max_steps; reading trainer.estimated_stepping_batches here would
        # make Lightning build the dataloader early and drop its restored state.
        return configure_optimizers(self.model, self.config.optimizer, self.config.scheduler, self.schedule_steps,
                                    self.start_step - self.schedule_first_step, self.schedule_first_step)

    def lr_at(self, step: int) -> float:
        """The peak lr x the schedule's factor at global step `step` (configure_optimizers' schedule)."""
        factor = lr_factor(self.config.scheduler, self.schedule_steps, self.start_step - self.schedule_first_step)
        return self.config.optimizer.lr * factor(step - self.schedule_first_step)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A phase starting from the checkpoint that ended the phase before: the optimizer state carries over, but
        the peak lr and weight decay are this phase's (optimizer.lr and weight_decay may change between phases:
        every group's is rescaled by the new / the saved value, so Muon's own lr keeps its ratio), and so is the lr
        of its first step (its schedule's; configure_optimizers rebuilds the schedule for the steps after)."""
        if self.phase_start is None or checkpoint.get("global_step") != self.phase_start:
            return
        now = self.config.optimizer
        saved = ((checkpoint.get(CHECKPOINT_KEY) or {}).get("config") or {}).get("optimizer") or {}
        lr_ratio = now.lr / saved.get("lr", now.lr)
        decay_ratio = now.weight_decay / saved["weight_decay"] if saved.get("weight_decay") else 1.0
        factor = self.lr_at(self.phase_start) / now.lr  # the schedule's factor at the phase's first step
        for scheduler in checkpoint.get("lr_schedulers", []):
            scheduler["base_lrs"] = [base * lr_ratio for base in scheduler.get("base_lrs", [])]
        for group in _param_groups(checkpoint.get("optimizer_states", [])):
            group["initial_lr"] = group.get("initial_lr", group["lr"]) * lr_ratio
            group["lr"] = group["initial_lr"] * factor
            group["weight_decay"] = group.get("weight_decay", 0.0) * decay_ratio

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.check_finite(f"before writing the checkpoint of global step {self.trainer.global_step}")
        checkpoint[CHECKPOINT_KEY] = {
            "model_config": self.model.config.to_hub_dict(),
            "tokenizer": self.config.data.tokenizer,
            "config": OmegaConf.to_container(OmegaConf.structured(self.config)),
        }


def _param_groups(states) -> list[dict]:
    """The param groups of saved optimizer states: a plain optimizer's, or those inside a combined one's
    (neobert.lit.optim.MuonWithAdamW: {"muon": ..., "adamw": ...})."""
    groups = []
    for state in states:
        if "param_groups" in state:
            groups += state["param_groups"]
        else:
            groups += _param_groups([inner for inner in state.values() if isinstance(inner, dict)])
    return groups

