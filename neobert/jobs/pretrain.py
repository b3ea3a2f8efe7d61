"""MLM pretraining, the whole job: check the config, build the data and the model, train (or resume), export
in the hub layout, and summarise (final losses, the loss plot). `python -m experiments.pretrain` is its
command line; docs/pretraining.md the guide.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Sequence

import lightning as L
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from neobert.config import ConfigError, config_path, load_config
from neobert.config.pretrain import PretrainConfig
from neobert.data.demo_corpus import write_demo_corpus
from neobert.data.offline_corpus import write_small_offline_source
from neobert.data.corpus import pretokenize, unigram_entropy
from neobert.data.mixture import mixture_sources
from neobert.data.pretraining import PretrainingDataModule
from neobert.data.tokenizer import BERT_BASE_UNCASED_ALIASES, load_tokenizer
from neobert.errors import CheckpointError, RunInterrupted
from neobert.eval.plots import final_value, plot_curves
from neobert.layout import CONFIG_NAME, EMA_EXPORT_DIR, EXPORT_DIR, LOGS_DIR, LOSS_PLOT, TENSORBOARD_DIR, WEIGHTS_NAME
from neobert.layout import metrics_csvs
from neobert.lit.checkpoints import (CHECKPOINT_KEY, model_state_dict, newest_readable_checkpoint,
                                     read_lightning_checkpoint, refuse_another_optimizer, refuse_existing_checkpoints,
                                     resume_checkpoint, step_checkpoint_callback, verified_checkpoint,
                                     verify_checkpoint)
from neobert.lit.ema import ExponentialMovingAverage
from neobert.lit.glue_callback import GlueEvalCallback
from neobert.lit.mteb_callback import MtebEvalCallback
from neobert.lit.pretrain import MLMPretrainingModule
from neobert.lit.strategies import master_state_dict
from neobert.lit.trainer import build_trainer, check_strategy_has_its_device, trains_on_gpu
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model.config import ModelFieldError
from neobert.model.attention import cuda_capability
from neobert.model.kernels import compile_pays, eager_reason
from neobert.model.checkpoint import load_state_dict_strict, read_weights, submodule_state
from neobert.outputs import (EXPORT, check_writable, claim_output_dir, clear_output_dir, hold_output_dir,
                             is_within)

log = logging.getLogger(__name__)
DEMO_CONFIG = "demo"  # the embedded default: `python -m experiments.pretrain` with no --config


def load_pretrain_config(config: str | None = None, overrides: Sequence[str] = ()) -> PretrainConfig:
    """The run's config: a YAML path or packaged name (default: the demo). The offline corpora it names are
    written first, when missing, so the demo and recipes/cpu-phases run offline: the demo's corpus (CPython's
    documentation topics, at the demo's data.source) and the small offline corpora (neobert.data.offline_corpus).
    Any other source is the user's data and is never written."""
    path = config_path(config or DEMO_CONFIG)
    loaded = load_config(PretrainConfig, path, overrides)
    demo_corpus = load_config(PretrainConfig, config_path(DEMO_CONFIG)).data.source
    for source in local_sources_named(loaded):
        if source == demo_corpus:
            write_demo_corpus(source)
        else:
            write_small_offline_source(source)
    return loaded


def local_sources_named(config: PretrainConfig) -> set[str]:
    """Every data source the config names: data.source, data.sources and those of its phases' overrides."""
    sources = {config.data.source} | {s.source for s in config.data.sources}
    for phase in config.phases:
        sources.add(phase.overrides.get("data.source"))
        sources |= {s["source"] for s in phase.overrides.get("data.sources") or [] if isinstance(s, dict)}
    return {source for source in sources if source}


def build_model_config(config: PretrainConfig, tokenizer) -> NeoBERTConfig:
    """The preset plus overrides, checked before any work; the vocabulary follows a non-BERT tokenizer, the
    attention backend the data (PretrainConfig.derived_model_overrides)."""
    overrides = {**config.model.overrides, **config.derived_model_overrides()}
    if config.data.tokenizer not in BERT_BASE_UNCASED_ALIASES:
        overrides.setdefault("vocab_size", len(tokenizer))
        overrides.setdefault("pad_token_id", tokenizer.pad_token_id)
    try:
        model_config = NeoBERTConfig.from_preset(config.model.preset, **overrides)
    except (ValueError, TypeError) as err:
        if isinstance(err, ModelFieldError) and err.field in overrides:  # name the override
            raise err.as_config_error("model.overrides.") from err
        raise ConfigError(f"invalid config key 'model': {err}") from err
    if model_config.vocab_size < len(tokenizer):
        raise ConfigError(f"invalid config key 'model.overrides.vocab_size': {model_config.vocab_size} is smaller "
                          f"than the tokenizer's {len(tokenizer)} tokens ({config.data.tokenizer})")
    if config.data.max_length > model_config.max_length:
        raise ConfigError(f"invalid config key 'data.max_length': {config.data.max_length} exceeds the model's "
                          f"max_length {model_config.max_length} (set model.overrides.max_length)")
    return model_config


def decide_compile(config: PretrainConfig, device_type: str, capability: tuple[int, int] | None = None,
                   triton: bool | None = None) -> PretrainConfig:
    """The config as it trains on `device_type` (a GPU of this compute capability, None: this one; with Triton or
    without, None: as installed here): model.compile=auto decided by the model's rule
    (`neobert.model.kernels.compile_pays`), data.static_shapes=auto following it; where auto stays eager, the eager
    run of model.compile=false (compile_scope and compile_mode at their defaults). A copy; true and false come back
    as they are."""
    if config.model.compile != "auto":
        return config
    compiled = compile_pays(device_type, capability, triton)
    defaults = type(config.model)()
    model = dataclasses.replace(config.model, compile=True) if compiled else dataclasses.replace(
        config.model, compile=False, compile_scope=defaults.compile_scope, compile_mode=defaults.compile_mode)
    decided = dataclasses.replace(config, model=model, data=dataclasses.replace(config.data))
    decided.resolve()  # data.static_shapes=auto follows the decision
    return decided


def prepare(config: PretrainConfig, phase=None):
    """Everything that can fail on a config that was loaded (resolved and validated by the loader, or by
    neobert.jobs.phases.phase_config for a phase), before any training work: returns (tokenizer, model config,
    datamodule). `phase`: the neobert.jobs.phases.PhaseRun this run is, if any."""
    tokenizer = load_tokenizer(config.data.tokenizer, max_length=config.data.max_length, config_key="data.tokenizer")
    model_config = build_model_config(config, tokenizer)
    datamodule = PretrainingDataModule(config.data, config.masking, tokenizer, config.trainer.micro_batch_size,
                                       trainer=config.trainer, phase=phase.name if phase else "",
                                       first_step=phase.start_step if phase else 0)
    datamodule.check_source()
    if config.init_from and not Path(config.init_from).exists():
        raise ConfigError(f"invalid config key 'init_from': {config.init_from!r} does not exist")
    if config.branch_from:
        branch_step(config)  # readable, and before trainer.max_steps
    if not config.resume:
        refuse_existing_checkpoints(config.output_dir)
    return tokenizer, model_config, datamodule


# Model fields a continued run may change (a phase): they shape no weight. The others must match the checkpoint.
CONTINUABLE_MODEL_FIELDS = ("rope_theta", "max_length", "attention_backend", "dropout", "classifier_dropout")


def refuse_another_model(checkpoint: Path, model_config: NeoBERTConfig) -> None:
    """A checkpoint to continue (resume, a phase, branch_from) must hold this run's model: a CheckpointError naming
    the fields that differ, instead of a size-mismatch traceback from the state dict."""
    saved = (verified_checkpoint(checkpoint).get(CHECKPOINT_KEY) or {}).get("model_config")
    if saved is None:
        return  # not written by this suite's pretraining: the state dict load says what does not fit
    now = model_config.to_hub_dict()
    differing = sorted(key for key in set(saved) | set(now) if saved.get(key) != now.get(key)
                       and key not in CONTINUABLE_MODEL_FIELDS)
    if differing:
        shown = ", ".join(f"{key} {saved.get(key)!r} there, {now.get(key)!r} here" for key in differing[:4])
        raise CheckpointError(f"{checkpoint} holds another model than this config builds ({shown}"
                              f"{', ...' if len(differing) > 4 else ''}): continue it with its own model settings, "
                              f"or give this run another output_dir")


EXPORT_NOT_OWNED = ("invalid config key 'export_dir': {directory} holds an export this run did not write ({held}): "
                    "choose another export_dir, or remove it (a run replaces only its own export: one inside its "
                    "output_dir, or the export_dir of the checkpoint it continues)")


def refuse_another_data_layout(checkpoint: Path | None, datamodule: PretrainingDataModule, world_size: int) -> None:
    """Readers that cannot share data.streams, or a checkpoint whose data position cannot go on exactly on this run's
    devices, nodes, workers and batch (`PretrainingDataModule.check_resume`), are refused before the Trainer starts:
    one line, nothing written."""
    datamodule.world_size = world_size
    saved = verified_checkpoint(checkpoint).get(type(datamodule).__qualname__) if checkpoint is not None else None
    if saved is not None:
        datamodule.check_resume(saved)
    elif problem := datamodule.layout().problem():
        raise ConfigError(f"invalid config key 'data.streams': {problem}")


def claim_export_dir(config: PretrainConfig, ckpt_path: Path | None) -> None:
    """The end-of-run export replaces only this run's own export (neobert.outputs.claim_output_dir): one inside its
    output_dir, or the export_dir its own checkpoint was written with (a resumed run). Another run's export, files
    that are not an export's, checkpoints or this run's inputs there are refused before any training work."""
    output_dir = Path(config.output_dir)
    export_dir = Path(config.export_dir or output_dir / EXPORT_DIR)
    if is_within(output_dir, export_dir):
        raise ConfigError(f"invalid config key 'export_dir': {export_dir} holds this run's "
                          f"output_dir={str(output_dir)!r}: the export goes into a directory of its own (by default "
                          f"output_dir/{EXPORT_DIR})")
    own = is_within(export_dir, output_dir)
    if not own and ckpt_path is not None and is_within(ckpt_path, output_dir) and export_dir.is_dir():
        saved = ((verified_checkpoint(ckpt_path).get(CHECKPOINT_KEY) or {}).get("config") or {}).get("export_dir")
        own = saved is not None and Path(saved).resolve() == export_dir.resolve()
    claim_output_dir(export_dir, EXPORT, where=f"invalid config key 'export_dir': {export_dir}", noun="export_dir",
                     earlier=EXPORT_NOT_OWNED, overwrite=own,
                     inputs=[(f"{key}={value!r}", value) for key, value in (
                         ("init_from", config.init_from), ("branch_from", config.branch_from),
                         ("data.tokenizer", config.data.tokenizer))])
    check_writable(export_dir, f"invalid config key 'export_dir': {export_dir}")  # not found after training


def branch_step(config: PretrainConfig) -> int:
    """The optimizer step of the `branch_from` checkpoint, where the branch starts (its decay, in phase=decay)."""
    if not Path(config.branch_from).exists():
        raise ConfigError(f"invalid config key 'branch_from': {config.branch_from!r} does not exist")
    try:
        step = verify_checkpoint(config.branch_from)  # memory-mapped: the tensors are not read
    except CheckpointError as err:
        raise CheckpointError(f"branch_from: {config.branch_from} is not a readable checkpoint: {err}") from err
    if step >= config.trainer.max_steps:
        raise ConfigError(f"invalid config key 'trainer.max_steps': {config.trainer.max_steps} is not after the "
                          f"step of branch_from ({step}); the branch trains until trainer.max_steps")
    return step


def refuse_a_step_past_max_steps(config: PretrainConfig, ckpt_path: Path) -> None:
    """A resume never shortens a run: a checkpoint past trainer.max_steps is refused (Lightning would stop at once
    and export it again without a word); one at trainer.max_steps is said to train nothing."""
    step, max_steps = verify_checkpoint(ckpt_path), config.trainer.max_steps
    if step > max_steps:
        raise ConfigError(f"invalid config key 'trainer.max_steps': {max_steps} is before the step of {ckpt_path} "
                          f"({step}): a resumed run goes on from its checkpoint, it never shortens it; set "
                          f"trainer.max_steps above {step} to train on, or choose another output_dir")
    if step == max_steps:
        log.warning("%s is at trainer.max_steps=%d already: nothing to train, the model is exported again",
                    ckpt_path, max_steps)


def build_callbacks(config: PretrainConfig) -> list[L.Callback]:
    callbacks: list[L.Callback] = [step_checkpoint_callback(config.output_dir, config.trainer)]
    if config.glue_callback.every_n_steps > 0:
        callbacks.append(GlueEvalCallback(config.glue_callback))
    if config.mteb_callback.every_n_steps > 0:
        callbacks.append(MtebEvalCallback(config.mteb_callback))
    return callbacks


def run_pretraining(config: PretrainConfig, extra_callbacks: Sequence[L.Callback] = (), phase=None) -> Path:
    """Trains (or resumes) and exports, holding output_dir throughout (a second run into it is refused); returns
    the export directory. `phase`: one phase of a phased recipe (neobert.jobs.phases.PhaseRun)."""
    with hold_output_dir(config.output_dir):
        return train_and_export(config, extra_callbacks, phase)


def train_and_export(config: PretrainConfig, extra_callbacks: Sequence[L.Callback] = (), phase=None) -> Path:
    """`run_pretraining` once its output_dir is held."""
    if config.phases and phase is None:
        raise ConfigError("invalid config key 'phases': a phased recipe runs phase by phase "
                          "(neobert.jobs.phases.run_phases; `python -m experiments.pretrain` does)")
    check_strategy_has_its_device(config.trainer)
    config = decided_for_this_run(config)
    tokenizer, model_config, datamodule = prepare(config, phase)
    ckpt_path = resume_checkpoint(config.output_dir) if config.resume else None
    L.seed_everything(config.trainer.seed, workers=True)
    module = MLMPretrainingModule(config, model_config, tokenizer)
    if phase is not None:
        module.schedule_steps = phase.schedule_end - phase.schedule_start
        module.schedule_first_step, module.phase_start = phase.schedule_start, phase.start_step
        if config.scheduler.phase == "decay":  # a wsd decay phase decays from its own first step
            module.start_step = phase.start_step
        ckpt_path = phase.checkpoint(ckpt_path)
        if ckpt_path is None and config.init_from:  # the first phase, from a released checkpoint
            init_weights(module.model, config.init_from)
    elif config.branch_from:
        module.start_step = branch_step(config) if config.scheduler.phase == "decay" else 0
        ckpt_path = ckpt_path or Path(config.branch_from)  # the branch's own checkpoints once it has some
    elif ckpt_path is None and config.init_from:
        init_weights(module.model, config.init_from)
    if ckpt_path is not None:
        refuse_another_model(ckpt_path, model_config)  # before the Trainer creates this run's log directories
        refuse_another_optimizer(ckpt_path, config.optimizer.name, f"start a new run in another output_dir with "
                                 f"init_from={ckpt_path} (its weights, a new {config.optimizer.name} optimizer)")
        if phase is None:  # a phase's steps are its own (phases.py)
            refuse_a_step_past_max_steps(config, ckpt_path)
    claim_export_dir(config, ckpt_path)  # before any training work: the export replaces only its own
    trainer = build_trainer(config.trainer, config.logging, config.output_dir,
                            callbacks=build_callbacks(config) + list(extra_callbacks),
                            micro_batch_size=config.trainer.micro_batch_size,
                            validate=config.data.validation_docs > 0,
                            max_epochs=-1,  # the training stream is endless: max_steps ends the run
                            use_distributed_sampler=False)  # every rank reads its own streams
    refuse_another_data_layout(ckpt_path, datamodule, trainer.world_size)
    baselines = {}  # per source of a mixture ("" for data.source)
    if config.data.baseline_docs and trainer.is_global_zero:
        for source in mixture_sources(config.data):
            baselines[source.name] = unigram_entropy(source.data, tokenizer, config.data.baseline_docs)
            print(f"unigram-entropy baseline of {source.name or 'the corpus'} (masked-target tokens): "
                  f"{baselines[source.name]:.4f} nats")
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except SystemExit as exit_:
        if not trainer.interrupted:
            raise
        # Lightning shut down gracefully after a Ctrl-C and exits with status 1: say where the run stopped instead
        resume_from, _ = newest_readable_checkpoint(config.output_dir)
        where = (f"the newest checkpoint is {resume_from} (global step {verify_checkpoint(resume_from)})"
                 if resume_from else "no checkpoint was written yet")
        raise RunInterrupted(f"the run stopped at global step {trainer.global_step}; {where}: run the same command "
                             f"with resume=true to continue from it") from exit_
    if phase is not None and ckpt_path != phase.final_checkpoint:
        trainer.save_checkpoint(phase.final_checkpoint)  # where the next phase starts; never rotated away

    export_dir = Path(config.export_dir or Path(config.output_dir) / EXPORT_DIR)
    if trainer.is_global_zero:
        clear_output_dir(export_dir, EXPORT)  # claimed at the start: no stale averaging.json, ema/, ...
    export_module(module, export_dir, trainer.is_global_zero)
    ema = next((c for c in trainer.callbacks if isinstance(c, ExponentialMovingAverage)), None)
    if ema is not None and ema.weights is not None and trainer.is_global_zero:
        export_weights(module, submodule_state(ema.weights, "model."), export_dir / EMA_EXPORT_DIR)
    if trainer.is_global_zero:
        summarise(config, export_dir, baselines)
    return export_dir


def decided_for_this_run(config: PretrainConfig) -> PretrainConfig:
    """`decide_compile` for this machine's device, said in one line where model.compile=auto decided it."""
    device_type = "cuda" if trains_on_gpu(config.trainer) else "cpu"
    decided = decide_compile(config, device_type)
    if decided is not config:
        log.info("%s (model.compile=false trains eager)", compile_decision(decided, device_type))
    return decided


def compile_decision(decided: PretrainConfig, device_type: str, capability: tuple[int, int] | None = None,
                     triton: bool | None = None) -> str:
    """In words, what model.compile=auto became in the `decided` config (`decide_compile`'s, with these arguments),
    and why."""
    why = eager_reason(device_type, capability, triton)
    if why is not None:
        return f"model.compile=auto: eager, as model.compile=false: {why}"
    major, minor = cuda_capability() if capability is None else capability
    return (f"model.compile=auto: compiled (compile_scope={decided.model.compile_scope}, compile_mode="
            f"{decided.model.compile_mode}): compute capability {major}.{minor} (Hopper or later) and Triton installed")


def run_pretokenize(config: PretrainConfig, out_dir: str | Path) -> list[Path]:
    """Writes the config's documents as token-id parquet shards for `data.pretokenized_dir`."""
    if config.data.sources:
        raise ConfigError("invalid config key 'data.sources': --pretokenize writes one source's shards (a mixture "
                          "tokenizes as it streams): run it with data.source=<one source> data.sources=[]")
    tokenizer = load_tokenizer(config.data.tokenizer, config_key="data.tokenizer")
    return pretokenize(config.data, tokenizer, out_dir)


def init_weights(model: NeoBERTForMaskedLM, source: str | Path) -> None:
    """Stage 2 starts from stage 1: an export directory (hub layout) or a Lightning checkpoint (a .ckpt file, or a
    DeepSpeed or sharded fsdp2 checkpoint directory, read on this process alone: `read_lightning_checkpoint`)."""
    source = Path(source)
    if source.is_dir() and (source / CONFIG_NAME).is_file():
        load_state_dict_strict(model, read_weights(source / WEIGHTS_NAME), source=str(source))
    elif source.exists():
        load_state_dict_strict(model, model_state_dict(read_lightning_checkpoint(source), str(source)), str(source))
    else:
        raise ConfigError(f"invalid config key 'init_from': {str(source)!r} does not exist")
    log.info("initialised the model from %s", source)


def export_module(module: MLMPretrainingModule, export_dir: str | Path, is_global_zero: bool) -> None:
    """Writes the trained model. Sharded (FSDP2) weights and DeepSpeed's fp32 master weights are gathered first,
    a collective on every rank."""
    state = master_state_dict(module.model, module.trainer.strategy)
    if any(hasattr(t, "full_tensor") for t in state.values()):
        state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_global_zero:
        export_weights(module, state, export_dir)


def export_weights(module: MLMPretrainingModule, state: dict, export_dir: str | Path) -> None:
    """One weight set of the module's model (the trained weights, or their EMA) in the hub layout."""
    model = NeoBERTForMaskedLM(module.model.config)
    load_state_dict_strict(model, {k: v.float().cpu() for k, v in state.items()}, "trained module")
    model.save_pretrained(export_dir, tokenizer=module.tokenizer)


def summarise(config: PretrainConfig, export_dir: Path, baselines: dict[str, float]) -> None:
    """`baselines`: the unigram-entropy baseline of each source ("" for data.source)."""
    output_dir = Path(config.output_dir)
    csvs = metrics_csvs(output_dir)
    lines = {f"unigram-entropy baseline{' ' + name if name else ''}": value for name, value in baselines.items()}
    plot = output_dir / LOSS_PLOT
    curves = ["train/loss", "val/loss"] + (["val/loss_ema"] if config.trainer.ema.decay else [])
    curves += [f"val/loss/{source.name}" for source in config.data.sources]
    plot_curves(csvs, curves, plot, hlines=lines, title=f"MLM loss ({output_dir.name})")
    final = final_value(csvs, "train/loss", last_n=5)  # single steps are noisy: the mean of the last 5 logged
    final_val, final_ema = final_value(csvs, "val/loss"), final_value(csvs, "val/loss_ema")
    print((f"final train loss (mean of the last 5 logged steps) {final:.4f}" if final is not None
           else "no train loss logged (max_steps < logging.log_every_n_steps)")
          + (f", validation loss {final_val:.4f}" if final_val is not None else "")
          + (f" (EMA weights {final_ema:.4f})" if final_ema is not None else "")
          + "".join(f", unigram baseline{' of ' + name if name else ''} {value:.4f} nats"
                    for name, value in baselines.items()))
    print(f"export: {export_dir}\nloss plot: {plot}\n"
          f"logs: {output_dir / LOGS_DIR} (CSV), {output_dir / TENSORBOARD_DIR}")
