"""The preflight of a pretraining run (`python -m experiments.pretrain --config <recipe> --preflight
trainer.devices=8`): everything a GPU run builds except CUDA itself, on any machine, reported in one page.

It loads and checks the config, builds the tokenizer, the model (to count its parameters), the DataModule and its
DataLoader, and the Lightning strategy, and asks Lightning to format the DeepSpeed config the way its own setup
does, around that DataLoader. The report: the strategy and its DeepSpeed/FSDP settings, the batch arithmetic
(sequences and tokens per step, per GPU and in all), the data shards against ranks x workers, model-state memory
per GPU from DeepSpeed's ZeRO estimators (plus an activation estimate), the attention kernel, the MFU peak of the
named GPU and what the run costs at a stated MFU, and the data workers a GPU needs at that rate (one worker's
tokenize + mask rate, measured on this machine's CPU). What would crash is refused: a ConfigError naming the key.
The memory section is in preflight_memory.py, the kernel sections (the model's plan, in words) in preflight_kernels.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from neobert.config import ConfigError
from neobert.config.pretrain import PretrainConfig
from neobert.data.corpus import local_data_files, open_source, source_key, source_name
from neobert.data.demo_corpus import demo_documents
from neobert.data.mixture import mixture_sources
from neobert.data.pretraining import PretrainingDataModule
from neobert.data.stream_layout import StreamLayout
from neobert.data.tokenizer import load_tokenizer
from neobert.eval.flops import flops_per_token, matmul_params, peak_flops_of
from neobert.hub import hub_reachable
from neobert.instruments.data_pipeline import run_ours
from neobert.jobs.phases import plan_phases
from neobert.jobs.pretrain import build_model_config
from neobert.instruments.preflight_kernels import (DEFAULT_GPU, attention_section, gpu_capability, in_16_bits,
                                                   kernels_section, planned_capability, planned_run,
                                                   precision_section, resolve_precision_on_gpu)
from neobert.instruments.preflight_memory import GiB, config_activation_bytes, memory_section, world_size
from neobert.lit.strategies import is_deepspeed
from neobert.lit.trainer import build_strategy
from neobert.model import NeoBERTForMaskedLM

ASSUMED_MFU = 0.40  # for the cost line only: a typical well-tuned encoder pretraining MFU, not a measurement
WORKER_SAMPLE_DOCS = 1000  # demo documents timed through one worker's tokenize + mask


@dataclass
class Preflight:
    lines: list[str] = field(default_factory=list)
    refusals: list[tuple[str, str]] = field(default_factory=list)  # (config key, why)
    warnings: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # what it could not check (an unknown GPU's memory, peak)

    def section(self, title: str) -> None:
        self.lines += ["", f"## {title}"]

    def add(self, text: str) -> None:
        self.lines.append(text)

    def refuse(self, key: str, why: str) -> None:
        self.refusals.append((key, why))

    def text(self) -> str:
        lines = list(self.lines)
        if self.warnings:
            lines += ["", "## Warnings"] + [f"- {w}" for w in self.warnings]
        lines += ["", "## Verdict"]
        lines += ([f"- REFUSED ({key}): {why}" for key, why in self.refusals] if self.refusals
                  else ["- nothing found that would crash at setup" + " in what it could check" * bool(self.unchecked)])
        lines += [f"- not checked: {what}" for what in self.unchecked]
        return "\n".join(lines).lstrip() + "\n"


def run_preflight(config: PretrainConfig, gpu: str = DEFAULT_GPU) -> str:
    """Prints the report for `config` on `trainer.devices` x `trainer.num_nodes` GPUs named `gpu` and returns it;
    then, if anything would crash, raises ConfigError naming the first key (the report lists them all)."""
    if not gpu.strip():
        raise ConfigError("--gpu '' names no GPU: give the name torch.cuda.get_device_name() prints, e.g. "
                          f"{DEFAULT_GPU!r}")
    report = preflight_report(config, gpu)
    text = report.text()
    print(text, end="")
    if report.refusals:
        key, why = report.refusals[0]
        raise ConfigError(f"invalid config key '{key}': {why} (preflight: {len(report.refusals)} problem(s), "
                          f"listed above)")
    return text


def preflight_report(config: PretrainConfig, gpu: str = DEFAULT_GPU) -> Preflight:
    """Builds the run of a loaded config (resolved and validated by the loader) and checks it (see the module
    docstring)."""
    report = Preflight()
    given, capability = config, planned_capability(gpu)
    config = planned_run(config, capability)  # the run as it trains there: model.compile=auto decided
    trainer = config.trainer
    tokenizer = load_tokenizer(config.data.tokenizer, max_length=config.data.max_length,
                               config_key="data.tokenizer")
    model_config = build_model_config(config, tokenizer)
    model = NeoBERTForMaskedLM(model_config)
    parameters = sum(p.numel() for p in model.parameters())
    precision = resolve_precision_on_gpu(config)

    report.add(f"# Preflight: {config.output_dir} on {trainer.num_nodes} node(s) x {trainer.num_devices} GPU(s) "
               f"({gpu})")
    report.add(f"model: preset {config.model.preset}, {model_config.num_hidden_layers} x "
               f"{model_config.hidden_size}, {parameters / 1e6:.1f}M parameters; precision {precision}")

    strategy_section(report, config, precision, tokenizer)
    batch_section(report, config)
    data_section(report, config)
    precision_section(report, config, gpu)
    memory_section(report, config, model, parameters, gpu)
    attention_section(report, config, model_config, precision, gpu)
    kernels_section(report, given, model_config, capability)
    demand_per_gpu = mfu_section(report, config, model, model_config, gpu)
    workers_section(report, config, tokenizer, demand_per_gpu)
    if config.phases:
        phases_section(report, config, model_config, gpu)
    return report


def phases_section(report: Preflight, config: PretrainConfig, model_config, gpu: str = DEFAULT_GPU) -> None:
    """The phases on the step axis; the sections above are the first phase's. A phase that would not resolve is
    refused here, before any GPU time."""
    report.section("Phases (the sections above are the first phase's)")
    try:
        runs = plan_phases(config)
    except ConfigError as err:
        report.refuse("phases", str(err))
        return
    for run in runs:
        c = run.config
        tokens = c.trainer.batch_size * c.data.max_length
        sources = ", ".join(f"{s.name} {s.weight:g}" for s in c.data.sources) or c.data.source
        slots = (run.end_step - run.start_step) * tokens
        report.add(f"- {run.name}: steps {run.start_step:,}-{run.end_step:,} ({slots / 1e9:,.1f}B token slots at "
                   f"{tokens:,} per step), length {c.data.max_length}, micro-batch {c.trainer.micro_batch_size}, "
                   f"masking {c.masking.rate:g}, RoPE base {c.model.overrides.get('rope_theta', 'preset')}, lr peak "
                   f"{c.optimizer.lr:g} ({c.scheduler.name} {c.scheduler.phase}, schedule steps "
                   f"{run.schedule_start:,}-{run.schedule_end:,}); data: {sources}")
        activations = config_activation_bytes(c, model_config, gpu)
        report.add(f"  activations (estimate, as above): {activations / GiB:.1f} GiB per GPU")


def strategy_section(report: Preflight, config: PretrainConfig, precision: str, tokenizer) -> None:
    trainer = config.trainer
    report.section("Strategy")
    gpu_trainer = dataclasses.replace(trainer, precision=precision, accelerator="gpu")
    strategy = build_strategy(gpu_trainer, trainer.micro_batch_size)
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    report.add(f"trainer.strategy={trainer.strategy} -> {name}")
    if is_deepspeed(trainer.strategy):
        dataloader = PretrainingDataModule(config.data, config.masking, tokenizer, trainer.micro_batch_size,
                                           trainer=trainer).train_dataloader()  # built, never iterated
        source = SimpleNamespace(is_defined=lambda: True, dataloader=lambda: dataloader)
        lightning_trainer = SimpleNamespace(accumulate_grad_batches=trainer.accumulate_grad_batches,
                                            gradient_clip_val=trainer.gradient_clip_val,
                                            fit_loop=SimpleNamespace(_data_source=source))
        strategy._lightning_module = SimpleNamespace(trainer=lightning_trainer)
        try:
            strategy._format_config()  # Lightning's own formatting, as at setup
        except Exception as err:  # noqa: BLE001 - whatever Lightning raises here is what the GPU run would raise
            report.refuse("trainer.strategy", f"Lightning cannot format the DeepSpeed config: {err!r}")
            return
        finally:
            strategy._lightning_module = None
        report.add("DeepSpeed config (as Lightning hands it to deepspeed.initialize):")
        report.add("```json\n" + json.dumps(strategy.config, indent=1, sort_keys=True) + "\n```")
        report.add("The loss is divided by the accumulation once (Lightning), not again by DeepSpeed "
                   "(`scale_wrt_gas=False`); the export and the EMA read the fp32 master weights.")
        if trainer.ema.decay and trainer.ema.every_n_steps < 10:
            report.warnings.append(
                f"trainer.ema.every_n_steps={trainer.ema.every_n_steps} under DeepSpeed: every EMA update gathers "
                f"the fp32 master weights from the ZeRO partitions (a collective of the whole model); 10 or more "
                f"keeps it off the step time")
    elif trainer.strategy == "fsdp2":
        report.add("FSDP2 (fully_shard on every block, then the model), data-parallel over all ranks; "
                   + ("MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" if precision == "bf16-mixed"
                      else "no mixed-precision policy"))
    if precision in ("bf16-mixed", "16-mixed") and not is_deepspeed(trainer.strategy):
        report.add("AMP through ClippingMixedPrecision: gradient clipping works with the fused AdamW.")


def batch_section(report: Preflight, config: PretrainConfig) -> None:
    trainer, data = config.trainer, config.data
    world = world_size(config)
    sequences = trainer.batch_size
    report.section("Batch")
    report.add(f"- {trainer.micro_batch_size} sequences per GPU per micro-batch x {trainer.accumulate_grad_batches} "
               f"accumulation x {world} GPUs = {sequences:,} sequences per optimizer step")
    report.add(f"- at data.max_length={data.max_length}: {sequences * data.max_length:,} token slots per step "
               f"({trainer.micro_batch_size * data.max_length:,} per GPU per micro-batch); with packing "
               f"{data.packing!r} the real tokens are " + ("all of them" if data.packing != "none"
                                                           else "fewer (documents shorter than the length)"))
    if data.packing != "none":
        report.add(f"- data.static_shapes={data.static_shapes} (auto is model.compile's value): " + (
            "every packed micro-batch has one shape, for one compiled graph" if data.static_shapes == "true"
            else "every packed micro-batch has its own shapes"))
    total = trainer.max_steps * sequences * data.max_length
    report.add(f"- {trainer.max_steps:,} steps x {sequences * data.max_length:,} = {total / 1e9:,.1f}B token slots")
    warmup = trainer.batch_size_warmup
    if warmup.start_batch_size:
        report.add(f"- batch-size warm-up from {warmup.start_batch_size} sequences over {warmup.tokens / 1e9:g}B "
                   f"tokens")
    if data.validation_docs:
        report.add(f"- validation: the first {data.validation_docs:,} documents, every "
                   f"{trainer.eval_every_n_steps:,} steps; every rank runs the same number of validation batches")


def data_section(report: Preflight, config: PretrainConfig) -> None:
    data = config.data
    layout = StreamLayout(data.streams or world_size(config) * max(1, data.num_workers), world_size(config),
                          max(1, data.num_workers))
    streams = layout.streams
    report.section("Data")
    report.add(f"data.streams={streams}, read by {layout.world_size} ranks x {layout.workers} workers; every stream "
               f"reads its share of every source, and a resume may change the readers to any divisor of {streams}")
    if layout.problem():
        report.refuse("data.streams", layout.problem())
    for source in mixture_sources(data):
        source_section(report, source, streams)
    if data.num_workers == 0:
        report.warnings.append("data.num_workers=0: tokenization runs in the training process, between steps")
    if data.validation_docs:
        batches = math.ceil(data.validation_docs / config.trainer.micro_batch_size)  # an upper bound, before packing
        if batches < world_size(config):
            report.refuse("data.validation_docs", f"{data.validation_docs} documents (of each source) make at most "
                          f"{batches} validation batches of {config.trainer.micro_batch_size}, fewer than the "
                          f"{world_size(config)} ranks: some ranks would validate nothing")


def source_section(report: Preflight, source, streams: int) -> None:
    data = source.data
    name = f"{source.name} ({source.probability:.1%} of the draws" + (
        f", retired after {source.max_epochs} epoch(s))" if source.max_epochs else ")") if source.name else ""
    report.add(f"- source {name + ': ' if name else ''}{data.pretokenized_dir or data.source}")
    shards = None
    if data.pretokenized_dir or local_data_files(data.source, source_key(data)) is not None or hub_reachable():
        shards = open_source(data).n_shards
    if shards is None:
        report.add("  shards: unknown here (the hub cannot be reached); at the start of the run `datasets` reports "
                   "them. Whole shards per stream need the shard count to be a multiple of data.streams.")
    elif shards % streams == 0:
        report.add(f"  shards: {shards}, a multiple of {streams}: every stream reads {shards // streams} whole "
                   f"shard(s)")
    else:
        report.add(f"  shards: {shards}, not a multiple of {streams}: `datasets` falls back to every stream reading "
                   f"EVERY shard and keeping one document in {streams}, so each document is downloaded and "
                   f"decoded {streams} times")
        report.warnings.append(
            f"data: {source_name(data)} has {shards} shards over data.streams={streams}: choose data.streams so "
            f"that it divides the shards, or write pre-tokenized shards "
            f"(`--pretokenize DIR`, a multiple of the streams) and set data.pretokenized_dir")


def mfu_section(report: Preflight, config: PretrainConfig, model, model_config, gpu: str) -> float | None:
    """Reports the FLOPs and the peak; returns the tokens/s one GPU consumes at ASSUMED_MFU (None: unknown GPU)."""
    trainer, data = config.trainer, config.data
    report.section("MFU")
    weights = matmul_params(model)
    if config.model.masked_only_logits:
        weights -= (1 - config.masking.rate) * model.decoder.weight.numel()
    per_token = flops_per_token(weights, model_config.num_hidden_layers, model_config.hidden_size, data.max_length,
                                training=True)
    report.add(f"- training FLOPs per token: 6 x {weights / 1e6:.1f}M matmul weights + 12 x layers x hidden x "
               f"length = {per_token / 1e9:.2f} GFLOP at length {data.max_length} (train/mfu counts attention at "
               f"each batch's real lengths)")
    peak = peak_flops_of(gpu)
    if peak is None:
        report.add(f"- peak: unknown for {gpu!r}: train/mfu will not be logged")
        report.unchecked.append(f"the MFU, the cost and the data workers' pace (no peak FLOP/s known for {gpu!r})"
                                + ("; nor whether its kernels and precision run on it" * (gpu_capability(gpu) is None)))
        return None
    if not in_16_bits(resolve_precision_on_gpu(config)):
        report.add(f"- peak: a {gpu}'s published peak is a 16-bit tensor-core rate; this run computes in float32 "
                   f"(trainer.precision): train/mfu will not be logged")
        return None
    world = world_size(config)
    report.add(f"- peak of a {gpu}: {peak / 1e12:.0f} dense bf16 TFLOP/s per GPU")
    tokens_per_second = ASSUMED_MFU * peak * world / per_token
    total_tokens = trainer.max_steps * trainer.batch_size * data.max_length
    days = total_tokens / tokens_per_second / 86400
    report.add(f"- at {ASSUMED_MFU:.0%} MFU (an assumption, not a measurement): {tokens_per_second / 1e6:.2f}M "
               f"tokens/s on {world} GPUs, {days:,.1f} days ({days * 24 * world:,.0f} GPU hours) for the "
               f"{total_tokens / 1e9:,.0f}B token slots")
    return tokens_per_second / world


def workers_section(report: Preflight, config: PretrainConfig, tokenizer, demand_per_gpu: float | None) -> None:
    """What one data worker supplies (tokenize + mask, measured now on this CPU with the config's tokenizer and
    data settings, on the demo corpus) against what one GPU consumes at ASSUMED_MFU."""
    data, masking = config.data, config.masking
    report.section("Data workers")
    if data.pretokenized_dir:
        report.add("- pre-tokenized shards (data.pretokenized_dir): the workers only batch and mask")
        return
    texts = [doc["content"] for doc in demo_documents()[:WORKER_SAMPLE_DOCS]]
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one worker's CPU
    try:
        start = time.perf_counter()
        tokens = run_ours(texts, tokenizer, data, masking, config.trainer.micro_batch_size)
        rate = tokens / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(torch_threads)
    report.add(f"- one worker here tokenizes and masks {rate:,.0f} tokens/s ({WORKER_SAMPLE_DOCS} demo documents, "
               f"one thread of this machine's CPU: measure on the GPU nodes' CPUs for their figure)")
    if demand_per_gpu is None:
        report.add("- workers needed: not estimated (no MFU to assume: the GPU's peak is unknown, or the run computes "
                   "in float32; see MFU above)")
        return
    needed = math.ceil(demand_per_gpu / rate)
    report.add(f"- one GPU at {ASSUMED_MFU:.0%} MFU consumes {demand_per_gpu:,.0f} tokens/s: about {needed} worker(s) "
               f"per GPU at that rate; data.num_workers={data.num_workers}")
    if max(1, data.num_workers) < needed:
        report.warnings.append(
            f"data: {max(1, data.num_workers)} worker(s) per GPU supply about {max(1, data.num_workers) * rate:,.0f} "
            f"tokens/s at this CPU's rate, {demand_per_gpu:,.0f} needed: raise data.num_workers (CPU cores "
            f"permitting) or tokenize ahead (`--pretokenize DIR`, then data.pretokenized_dir=DIR)")
