"""The one place a Lightning `Trainer` is built: strategy, precision, loggers, progress bar, validation cadence,
atomic checkpoint writes, the EMA of the weights and the launch-environment check, from the shared `trainer` and `logging` config
sections. Every job and every evaluation callback builds its Trainer here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.profilers import AdvancedProfiler, PyTorchProfiler, SimpleProfiler
from lightning.pytorch.strategies import Strategy

from neobert.config import ConfigError, LoggingConfig, TrainerConfig
from neobert.eval.flops import warn_if_bf16_is_emulated
from neobert.layout import LOGS_DIR, PROFILE_NAME, TENSORBOARD_DIR
from neobert.lit.checkpoints import AtomicCheckpointIO
from neobert.lit.ema import ExponentialMovingAverage
from neobert.lit.strategies import deepspeed_strategy, fsdp2_strategy, is_deepspeed, mixed_precision_plugin

# Set by a cluster manager that starts every rank itself; Lightning then does not start ranks 1..N-1.
EXTERNAL_LAUNCHER_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS", "JSM_NAMESPACE_RANK")


def trains_on_gpu(config: TrainerConfig) -> bool:
    """Whether Lightning's accelerator finds a GPU for this trainer config on this machine."""
    return torch.cuda.is_available() and config.accelerator in ("auto", "gpu", "cuda")


def resolve_precision(config: TrainerConfig) -> str:
    if config.precision is not None:
        return str(config.precision)
    return "bf16-mixed" if trains_on_gpu(config) else "32-true"


def build_strategy(config: TrainerConfig, micro_batch_size: int | None = None) -> str | Strategy:
    """Lightning's strategy names pass through unchanged, except
    * "fsdp2": Lightning's ModelParallelStrategy with data parallelism only (the LightningModule applies
      `fully_shard` in configure_model);
    * DeepSpeed's names (deepspeed_stage_2, ...): the same Lightning strategy built as an object
      (neobert.lit.strategies: the micro-batch size it cannot read from our DataLoader, the loss divided by the
      accumulation once, checkpoints rewritten in place never left looking complete)."""
    if config.strategy == "fsdp2":
        return fsdp2_strategy()
    if is_deepspeed(config.strategy):
        return deepspeed_strategy(config.strategy, resolve_precision(config), micro_batch_size, config.deepspeed)
    return config.strategy


def checkpoint_plugins(strategy: str | Strategy) -> list:
    """The atomic checkpoint writer (temporary file + rename, `AtomicCheckpointIO`) for every strategy that
    writes its checkpoints through a CheckpointIO: single device, DDP, FSDP with full state dicts, and fsdp2's
    ModelParallelStrategy (it accepts the plugin; its default sharded checkpoints are directories written by
    torch.distributed.checkpoint, which does not use it, so only its single-file saves are atomic). Not for
    DeepSpeed, which writes its own checkpoint directories, nor for a Strategy object that brings its own."""
    if is_deepspeed(strategy):
        return []
    if isinstance(strategy, Strategy) and strategy._checkpoint_io is not None:
        return []  # Lightning refuses a CheckpointIO given both in the strategy and as a plugin
    return [AtomicCheckpointIO()]


def uses_own_precision(strategy: str | Strategy) -> bool:
    """A strategy whose precision plugin is not Lightning's MixedPrecision: one built with its plugin
    (our DeepSpeed), or a Lightning name that picks its own (FSDP1, DeepSpeed, XLA)."""
    if isinstance(strategy, Strategy):
        return strategy._precision_plugin is not None
    return strategy.startswith(("fsdp", "deepspeed", "xla"))


def check_strategy_has_its_device(config: TrainerConfig) -> None:
    """DeepSpeed runs on CUDA GPUs only, and Lightning says so once the fit starts (a traceback, after the data and
    the model are ready): refused before any work, naming the key, where this run would be on a CPU."""
    on_cpu = config.accelerator == "cpu" or (config.accelerator in ("auto", "gpu", "cuda")
                                             and not torch.cuda.is_available())
    if on_cpu and is_deepspeed(config.strategy):
        raise ConfigError(f"invalid config key 'trainer.strategy': {config.strategy} (DeepSpeed) runs on CUDA GPUs "
                          f"only, and this run has none (trainer.accelerator={config.accelerator}): on this machine "
                          f"use trainer.strategy=auto, or check the recipe for its GPUs with --preflight")


def check_launch_environment(config: TrainerConfig, environ=os.environ) -> None:
    """Lightning takes a set LOCAL_RANK to mean that a launcher has started every rank, so it starts none itself.
    Left behind by an earlier in-process run (a notebook, a test) with no launcher around, it makes a
    multi-device run wait forever for ranks that never start: fail before that instead."""
    launched = any(key in environ for key in EXTERNAL_LAUNCHER_VARIABLES)
    if config.num_devices * config.num_nodes > 1 and "LOCAL_RANK" in environ and not launched:
        raise ConfigError(
            f"LOCAL_RANK={environ['LOCAL_RANK']} is set but no launcher is (none of "
            f"{', '.join(EXTERNAL_LAUNCHER_VARIABLES)}): with trainer.devices={config.devices} Lightning would "
            "wait forever for ranks it never starts. Unset LOCAL_RANK (left over from an earlier run in this "
            "process?), or start the ranks with torchrun/srun.")


class ProgressBar(TQDMProgressBar):
    """Lightning's progress bar, also showing the module's `progress_bar_values` (Python numbers the module updates
    when it reads its metrics), so that nothing logged with prog_bar=True is read from the device every batch."""

    def get_metrics(self, trainer, pl_module) -> dict:
        return {**super().get_metrics(trainer, pl_module), **getattr(pl_module, "progress_bar_values", {})}


def build_loggers(logging: LoggingConfig, output_dir: str | Path | None) -> list:
    """CSV (`output_dir/logs/version_N/metrics.csv`) and TensorBoard (`output_dir/tensorboard/version_N`)."""
    if output_dir is None:
        return []
    makers = {"csv": lambda: CSVLogger(output_dir, name=LOGS_DIR),
              "tensorboard": lambda: TensorBoardLogger(output_dir, name=TENSORBOARD_DIR)}
    return [makers[name]() for name in logging.loggers]


def build_profiler(name: str | None, output_dir: str | Path | None):
    """Lightning's profiler by name, writing its report under `output_dir` (printed when there is none)."""
    if name is None:
        return None
    kinds = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}
    return kinds[name](dirpath=output_dir, filename=PROFILE_NAME if output_dir is not None else None)


def build_trainer(config: TrainerConfig, logging: LoggingConfig, output_dir: str | Path | None, *,
                  callbacks: Sequence[L.Callback] = (), validate: bool | None = None,
                  strategy: str | Strategy | None = None, micro_batch_size: int | None = None,
                  **overrides: Any) -> L.Trainer:
    """A Trainer for `config`. Validation runs every `config.eval_every_n_steps` optimizer steps (when `validate`
    is not False and the interval is set); metrics go to `output_dir` (None: no logger, nothing written).
    `strategy` replaces the configured one (e.g. a SingleDeviceStrategy for an evaluation inside another run);
    `micro_batch_size`: sequences per device per forward, for strategies that must be told (DeepSpeed);
    `overrides` are further Trainer arguments a job needs (e.g. use_distributed_sampler=False)."""
    check_launch_environment(config)
    precision = resolve_precision(config)
    on_cpu = config.accelerator == "cpu" or (config.accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and precision.startswith("bf16"):
        warn_if_bf16_is_emulated("cpu", torch.bfloat16)
    every = config.eval_every_n_steps if validate is not False else 0
    callbacks = list(callbacks)
    if config.ema.decay > 0:
        callbacks.append(ExponentialMovingAverage(config.ema.decay, config.ema.every_n_steps))
    if logging.progress_bar:
        callbacks.append(ProgressBar(refresh_rate=1))
    loggers = build_loggers(logging, output_dir)
    strategy = strategy if strategy is not None else build_strategy(config, micro_batch_size)
    plugins = list(overrides.pop("plugins", None) or [])
    if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
        plugins += checkpoint_plugins(strategy)
    # AMP through our plugin (gradient clipping with the fused optimizers) wherever Lightning would use its
    # MixedPrecision; FSDP1 and DeepSpeed bring their own precision plugins.
    amp = None
    if not uses_own_precision(strategy):
        amp = mixed_precision_plugin(precision, on_cpu)
        plugins += [amp] if amp is not None else []
    arguments = dict(
        accelerator=config.accelerator,
        devices=config.devices,
        num_nodes=config.num_nodes,
        strategy=strategy,
        plugins=plugins,
        # the precision is the plugin's where one is given (Lightning refuses both)
        precision=None if amp is not None or isinstance(strategy, Strategy) and uses_own_precision(strategy)
        else precision,
        max_steps=config.max_steps,
        max_epochs=config.max_epochs,
        accumulate_grad_batches=config.accumulate_grad_batches,
        gradient_clip_val=config.gradient_clip_val or None,
        # Validation every N optimizer steps = N x accumulation batches, across epochs (streams are endless).
        val_check_interval=every * config.accumulate_grad_batches if every else None,
        check_val_every_n_epoch=None,
        limit_val_batches=1.0 if every else 0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        logger=loggers or False,
        log_every_n_steps=min(logging.log_every_n_steps, every) if every else logging.log_every_n_steps,
        enable_progress_bar=logging.progress_bar,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
        default_root_dir=output_dir,
        profiler=build_profiler(config.profiler, output_dir),
    )
    arguments.update(overrides)
    return L.Trainer(**arguments)
