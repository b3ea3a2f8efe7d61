"""Masked-language-model pretraining on Lightning: the LightningModule, the Trainer/strategy builders, resume,
stage-2 initialisation and export. `run_pretraining(config)` is the whole job; `experiments/pretrain.py` is
its command line. The schema of `config` is `neobert.lit.pretrain_config.PretrainConfig`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import OmegaConf

from neobert.config import ConfigError
from neobert.data.pretraining import DATA_STATE_KEY, PretrainingDataModule, unigram_entropy
from neobert.data.tokenizer import BERT_BASE_UNCASED, load_tokenizer
from neobert.eval.flops import PEAK_FLOPS, flops_per_token, matmul_params, mfu
from neobert.lit.optim import build_adamw, parameter_groups, warmup_cosine, warmup_linear
from neobert.lit.pretrain_config import PretrainConfig, validate_config
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model.checkpoint import load_state_dict_strict

log = logging.getLogger(__name__)
CHECKPOINT_KEY = "neobert"  # our extra entry in Lightning checkpoints: model config + tokenizer + run config


# ---------------------------------------------------------------------------------------------- model config
def build_model_config(config: PretrainConfig, tokenizer) -> NeoBERTConfig:
    """The preset plus overrides, checked before any work; the vocabulary follows a non-BERT tokenizer."""
    overrides = dict(config.model.overrides)
    if config.data.tokenizer not in (BERT_BASE_UNCASED, "bert-base-uncased"):
        overrides.setdefault("vocab_size", len(tokenizer))
        overrides.setdefault("pad_token_id", tokenizer.pad_token_id)
    if config.data.packing:
        overrides.setdefault("attention_backend", "varlen")  # block-diagonal kernels on GPU
    try:
        model_config = NeoBERTConfig.from_preset(config.model.preset, **overrides)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid config key 'model': {err}") from err
    if model_config.vocab_size < len(tokenizer):
        raise ConfigError(f"invalid config key 'model.overrides.vocab_size': {model_config.vocab_size} is smaller "
                          f"than the tokenizer's {len(tokenizer)} tokens ({config.data.tokenizer})")
    if config.data.max_length > model_config.max_length:
        raise ConfigError(f"invalid config key 'data.max_length': {config.data.max_length} exceeds the model's "
                          f"max_length {model_config.max_length} (set model.overrides.max_length)")
    return model_config


# ---------------------------------------------------------------------------------------------- module
class MLMPretrainingModule(L.LightningModule):
    """`.model` is the NeoBERTForMaskedLM, `.tokenizer` its tokenizer (the evaluation callbacks use both)."""

    def __init__(self, config: PretrainConfig, model_config: NeoBERTConfig, tokenizer):
        super().__init__()
        self.config = config
        self.model = NeoBERTForMaskedLM(model_config)
        self.tokenizer = tokenizer
        self.masked_only = config.trainer.masked_only_logits
        self._sums = {"loss": 0.0, "correct": 0, "masked": 0, "tokens": 0}
        self._step_started: float | None = None
        # Training FLOPs per token; the decoder only runs at masked positions with masked-only logits.
        weights = matmul_params(self.model)
        if self.masked_only:
            weights -= (1 - config.masking.rate) * self.model.decoder.weight.numel()
        self.flops_per_token = flops_per_token(weights, model_config.num_hidden_layers, model_config.hidden_size,
                                               config.data.max_length, training=True)

    def configure_model(self) -> None:
        # FSDP2 (trainer.strategy=fsdp2): shard every block, then the rest.
        if getattr(self, "device_mesh", None) is not None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.model.transformer_encoder:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        if self.config.trainer.compile:
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
        self._sums["loss"] += float(output.loss.detach())
        self._sums["correct"] += correct
        self._sums["masked"] += masked
        self._sums["tokens"] += tokens
        accumulate = self.trainer.accumulate_grad_batches
        if (batch_idx + 1) % accumulate == 0:  # the last micro-batch of an optimizer step: log step means
            self._log_step(accumulate)
        return output.loss

    def _log_step(self, accumulate: int) -> None:
        sums, world = self._sums, self.trainer.world_size
        metrics = {
            "train/loss": sums["loss"] / accumulate,
            "train/accuracy": sums["correct"] / max(1, sums["masked"]),
            "train/lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            "train/tokens": float(sums["tokens"] * world),
        }
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
        self._sums = {"loss": 0.0, "correct": 0, "masked": 0, "tokens": 0}

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

    def configure_optimizers(self):
        # The schedule length is trainer.max_steps; reading trainer.estimated_stepping_batches here would
        # make Lightning build the dataloader early and drop its restored state.
        opt, sched, steps = self.config.optimizer, self.config.scheduler, self.config.trainer.max_steps
        if opt.name == "adamw":
            optimizer = build_adamw(self.model, opt.lr, opt.weight_decay, opt.betas, opt.eps,
                                    opt.decay_norms_biases_embeddings)
        else:  # Adam with coupled L2 decay (the M0 baseline)
            groups = parameter_groups(self.model, opt.weight_decay, opt.decay_norms_biases_embeddings)
            optimizer = torch.optim.Adam(groups, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps)
        if sched.name == "cosine":
            factor = warmup_cosine(sched.warmup_steps, steps, sched.decay_fraction, sched.final_ratio)
        else:
            factor = warmup_linear(sched.warmup_steps, steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "model_config": self.model.config.to_hub_dict(),
            "tokenizer": self.config.data.tokenizer,
            "config": OmegaConf.to_container(OmegaConf.structured(self.config)),
        }


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


# ---------------------------------------------------------------------------------------------- trainer
def resolve_precision(trainer_cfg) -> str:
    if trainer_cfg.precision is not None:
        return str(trainer_cfg.precision)
    on_gpu = torch.cuda.is_available() and trainer_cfg.accelerator in ("auto", "gpu", "cuda")
    return "bf16-mixed" if on_gpu else "32-true"


def build_strategy(trainer_cfg):
    """Lightning's strategy names pass through unchanged; "fsdp2" is Lightning's ModelParallelStrategy with
    data parallelism only (the module applies `fully_shard` in configure_model)."""
    if trainer_cfg.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size=1)
    return trainer_cfg.strategy


def build_callbacks(config: PretrainConfig) -> list:
    trainer_cfg = config.trainer
    callbacks = [
        ModelCheckpoint(dirpath=Path(config.run_dir) / "checkpoints", filename="step-{step:08d}",
                        auto_insert_metric_name=False, every_n_train_steps=trainer_cfg.checkpoint_every_n_steps,
                        save_last=True, save_top_k=trainer_cfg.keep_checkpoints, monitor="step", mode="max"),
    ]
    if trainer_cfg.progress_bar:
        callbacks.append(TQDMProgressBar(refresh_rate=1))
    if config.glue_callback.every_n_steps > 0:
        from neobert.lit.glue_callback import GlueEvalCallback

        callbacks.append(GlueEvalCallback(config.glue_callback))
    if config.mteb_callback.every_n_steps > 0:
        from neobert.lit.mteb_callback import MtebEvalCallback

        callbacks.append(MtebEvalCallback(config.mteb_callback))
    return callbacks


# Set by a cluster manager that starts every rank itself; Lightning then does not start ranks 1..N-1.
EXTERNAL_LAUNCHER_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS", "JSM_NAMESPACE_RANK")


def check_launch_environment(trainer_cfg, environ=os.environ) -> None:
    """Lightning takes a set LOCAL_RANK to mean that a launcher has started every rank, so it starts none itself.
    Left behind by an earlier in-process run (a notebook, a test) with no launcher around, it makes a
    multi-device run wait forever for ranks that never start: fail before that instead."""
    devices = int(trainer_cfg.devices) if str(trainer_cfg.devices).isdigit() else 1
    launched = any(key in environ for key in EXTERNAL_LAUNCHER_VARIABLES)
    if devices * trainer_cfg.num_nodes > 1 and "LOCAL_RANK" in environ and not launched:
        raise ConfigError(
            f"LOCAL_RANK={environ['LOCAL_RANK']} is set but no launcher is (none of "
            f"{', '.join(EXTERNAL_LAUNCHER_VARIABLES)}): with trainer.devices={trainer_cfg.devices} Lightning would "
            "wait forever for ranks it never starts. Unset LOCAL_RANK (left over from an earlier run in this "
            "process?), or start the ranks with torchrun/srun.")


def build_trainer(config: PretrainConfig, extra_callbacks: Sequence[L.Callback] = ()) -> L.Trainer:
    trainer_cfg = config.trainer
    check_launch_environment(trainer_cfg)
    validate = config.data.validation_docs > 0
    return L.Trainer(
        accelerator=trainer_cfg.accelerator,
        devices=trainer_cfg.devices,
        num_nodes=trainer_cfg.num_nodes,
        strategy=build_strategy(trainer_cfg),
        precision=resolve_precision(trainer_cfg),
        max_steps=trainer_cfg.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=trainer_cfg.accumulate_grad_batches,
        gradient_clip_val=trainer_cfg.gradient_clip_val or None,
        log_every_n_steps=trainer_cfg.log_every_n_steps,
        # The training stream is endless: validation runs every N optimizer steps (= N x accumulation batches).
        val_check_interval=trainer_cfg.val_check_interval * trainer_cfg.accumulate_grad_batches if validate else None,
        check_val_every_n_epoch=None,
        limit_val_batches=1.0 if validate else 0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # every rank reads its own streams; validation is split by hand
        callbacks=build_callbacks(config) + list(extra_callbacks),
        logger=[CSVLogger(config.run_dir, name="logs"), TensorBoardLogger(config.run_dir, name="tensorboard")],
        enable_progress_bar=trainer_cfg.progress_bar,
        enable_model_summary=False,
        default_root_dir=config.run_dir,
    )


# ---------------------------------------------------------------------------------------------- weights
def last_checkpoint(run_dir: str | Path) -> Path | None:
    path = Path(run_dir) / "checkpoints" / "last.ckpt"
    return path if path.exists() else None


def read_lightning_checkpoint(path: str | Path) -> dict:
    """A Lightning checkpoint written by this suite (a file, or a DeepSpeed checkpoint directory)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():  # DeepSpeed: gather the ZeRO partitions into one fp32 state dict
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            convert_zero_checkpoint_to_fp32_state_dict(str(path), f"{tmp}/model.ckpt")
            return torch.load(f"{tmp}/model.ckpt", map_location="cpu", weights_only=False)
    try:
        # Our own checkpoints: trusted files that also hold plain-Python loop and data state.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(f"{path} is not a readable checkpoint (corrupt or truncated?): {err}") from err


def mlm_state_dict(checkpoint: dict, source: str) -> dict:
    """The NeoBERTForMaskedLM weights of a Lightning checkpoint (keys without the module's `model.`)."""
    state = checkpoint.get("state_dict") or checkpoint.get("module")
    if state is None:
        raise ValueError(f"{source} has no state_dict: not a Lightning checkpoint")
    prefix = "model."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def init_weights(model: NeoBERTForMaskedLM, source: str | Path) -> None:
    """Stage 2 starts from stage 1: an export directory (hub layout) or a Lightning checkpoint."""
    source = Path(source)
    if source.is_dir() and (source / "config.json").is_file():
        from neobert.model.checkpoint import read_weights

        load_state_dict_strict(model, read_weights(source / "model.safetensors"), source=str(source))
    elif source.exists():
        load_state_dict_strict(model, mlm_state_dict(read_lightning_checkpoint(source), str(source)), str(source))
    else:
        raise ConfigError(f"invalid config key 'init_from': {str(source)!r} does not exist")
    log.info("initialised the model from %s", source)


def export_from_checkpoint(checkpoint_path: str | Path, export_dir: str | Path) -> Path:
    """`python -m experiments.export <ckpt> <dir>`: the hub layout with the tokenizer beside it."""
    checkpoint = read_lightning_checkpoint(checkpoint_path)
    extra = checkpoint.get(CHECKPOINT_KEY)
    if extra is None:
        raise ValueError(f"{checkpoint_path} was not written by neobert's pretraining (no '{CHECKPOINT_KEY}' entry)")
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_hub_dict(extra["model_config"]))
    load_state_dict_strict(model, mlm_state_dict(checkpoint, str(checkpoint_path)), str(checkpoint_path))
    max_length = extra.get("config", {}).get("data", {}).get("max_length")
    tokenizer = load_tokenizer(extra["tokenizer"], max_length=max_length, config_key="data.tokenizer")
    model.save_pretrained(export_dir, tokenizer=tokenizer)
    return Path(export_dir)


def export_module(module: MLMPretrainingModule, export_dir: str | Path, is_global_zero: bool) -> None:
    """Writes the trained model. Sharded (FSDP2) weights are gathered first, a collective on every rank."""
    state = module.model.state_dict()
    if any(hasattr(t, "full_tensor") for t in state.values()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_global_zero:
        return
    model = NeoBERTForMaskedLM(module.model.config)
    load_state_dict_strict(model, {k: v.float().cpu() for k, v in state.items()}, "trained module")
    model.save_pretrained(export_dir, tokenizer=module.tokenizer)


# ---------------------------------------------------------------------------------------------- the job
def prepare(config: PretrainConfig):
    """Everything that can fail on a bad config, before any training work: returns
    (tokenizer, model config, datamodule)."""
    validate_config(config)
    tokenizer = load_tokenizer(config.data.tokenizer, max_length=config.data.max_length, config_key="data.tokenizer")
    model_config = build_model_config(config, tokenizer)
    datamodule = PretrainingDataModule(config.data, config.masking, tokenizer, config.trainer.micro_batch_size)
    datamodule.check_source()
    if config.init_from and not Path(config.init_from).exists():
        raise ConfigError(f"invalid config key 'init_from': {config.init_from!r} does not exist")
    checkpoints = Path(config.run_dir) / "checkpoints"
    if not config.resume and checkpoints.is_dir() and any(checkpoints.glob("*.ckpt")):
        raise ConfigError(f"run_dir={config.run_dir!r} already holds checkpoints: set resume=true to continue "
                          f"that run, or choose another run_dir")
    return tokenizer, model_config, datamodule


def run_pretraining(config: PretrainConfig, extra_callbacks: Sequence[L.Callback] = ()) -> Path:
    """Trains (or resumes) and exports; returns the export directory. With `data.baseline_docs` > 0 it also
    computes the unigram-entropy baseline over that many training documents, prints it and draws it on the
    loss plot."""
    tokenizer, model_config, datamodule = prepare(config)
    L.seed_everything(config.trainer.seed, workers=True)
    module = MLMPretrainingModule(config, model_config, tokenizer)
    ckpt_path = last_checkpoint(config.run_dir) if config.resume else None
    if config.resume and ckpt_path is None:
        log.info("resume=true but %s has no last.ckpt: starting a new run", config.run_dir)
    if ckpt_path is None and config.init_from:
        init_weights(module.model, config.init_from)
    trainer = build_trainer(config, extra_callbacks)
    baseline = None
    if config.data.baseline_docs and trainer.is_global_zero:
        baseline = unigram_entropy(config.data, tokenizer, config.data.baseline_docs)
        print(f"unigram-entropy baseline of the corpus (masked-target tokens): {baseline:.4f} nats")
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)

    export_dir = Path(config.export_dir or Path(config.run_dir) / "export")
    export_module(module, export_dir, trainer.is_global_zero)
    if trainer.is_global_zero:
        summarise(config, export_dir, baseline)
    return export_dir


def summarise(config: PretrainConfig, export_dir: Path, baseline: float | None) -> None:
    from neobert.lit.plotting import final_value, plot_curves

    run_dir = Path(config.run_dir)
    csvs = sorted((run_dir / "logs").glob("version_*/metrics.csv"))
    lines = {"unigram-entropy baseline": baseline} if baseline is not None else {}
    plot = run_dir / "loss.png"
    plot_curves(csvs, ["train/loss", "val/loss"], plot, hlines=lines, title=f"MLM loss ({run_dir.name})")
    final = final_value(csvs, "train/loss", last_n=5)  # single steps are noisy: the mean of the last 5 logged
    final_val = final_value(csvs, "val/loss")
    print((f"final train loss (mean of the last 5 logged steps) {final:.4f}" if final is not None
           else "no train loss logged (max_steps < trainer.log_every_n_steps)")
          + (f", validation loss {final_val:.4f}" if final_val is not None else "")
          + (f", unigram baseline {baseline:.4f} nats" if baseline is not None else ""))
    print(f"export: {export_dir}\nloss plot: {plot}\nlogs: {run_dir / 'logs'} (CSV), {run_dir / 'tensorboard'}")
