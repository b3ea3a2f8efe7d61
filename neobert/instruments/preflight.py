"""The preflight of a pretraining run (`python -m experiments.pretrain --config <recipe> --preflight
trainer.devices=8`): everything a GPU run builds except CUDA itself, on any machine, reported in one page.

It loads and checks the config, builds the tokenizer, the model (to count its parameters), the DataModule and its
DataLoader, and the Lightning strategy, and asks Lightning to format the DeepSpeed config the way its own setup
does, around that DataLoader. The report: the strategy and its DeepSpeed/FSDP settings, the batch arithmetic
(sequences and tokens per step, per GPU and in all), the data shards against ranks x workers, model-state memory
per GPU from DeepSpeed's ZeRO estimators (plus an activation estimate), the attention kernel, the MFU peak of the
named GPU and what the run costs at a stated MFU, and the data workers a GPU needs at that rate (one worker's
tokenize + mask rate, measured on this machine's CPU). What would crash is refused: a ConfigError naming the key.
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
from neobert.config.pretrain import CUDA_GRAPH_MODES, PretrainConfig
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
from neobert.lit.optim import muon_split
from neobert.lit.strategies import is_deepspeed, loop_dtypes
from neobert.lit.trainer import build_strategy
from neobert.model import NeoBERTForMaskedLM
from neobert.model.attention import training_attention_kernel

DEFAULT_GPU = "NVIDIA H100 80GB HBM3"  # what torch.cuda.get_device_name() says on an H100 SXM
ASSUMED_MFU = 0.40  # for the cost line only: a typical well-tuned encoder pretraining MFU, not a measurement
GPU_MEMORY_GIB = {"h100": 80, "h200": 141, "a100": 80}
GiB = 2**30
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


def world_size(config: PretrainConfig) -> int:
    return config.trainer.num_devices * config.trainer.num_nodes


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
    memory_section(report, config, model, parameters, gpu)
    attention_section(report, config, model_config, precision, gpu)
    kernels_section(report, config, model_config)
    demand_per_gpu = mfu_section(report, config, model, model_config, gpu)
    workers_section(report, config, tokenizer, demand_per_gpu)
    if config.phases:
        phases_section(report, config, model_config)
    return report


def activation_bytes(model_config, tokens: int, precision: str, scored_rows: float, fused_loss: bool = False,
                     mlp_kernels: str = "eager") -> float:
    """Bytes a micro-batch of `tokens` tokens holds for its backward, term by term: what each op of the encoder keeps
    with the fused attention and norm kernels of a GPU (a norm keeps its input and a per-row scale; attention its
    inputs, output and per-row log-sum-exp), then the MLM head over its `scored_rows` (the masked tokens when only
    those are projected; with `fused_loss`, Liger's, no logits are kept). `precision` decides the widths: under mixed
    precision the residual stream (every norm's input) stays float32 and the matmuls read 16-bit copies; 16-true
    and 32-true keep one width throughout. `mlp_kernels`: what runs the SwiGLU MLP (`mlp_kernels_that_run`), whose
    kernels keep less than the eager ops. tests/test_preflight.py checks it against the tensors the model saves on a
    CPU (eager; Liger's and QuACK's from their sources)."""
    half = in_16_bits(precision)
    width = 2 if half else 4  # every matmul's input and output
    residual = 4 if precision.endswith("mixed") or not half else 2  # the residual stream, every norm's input
    h, f = model_config.hidden_size, model_config.ffn_hidden_size
    per_layer = (2 * residual * h  # the two norms' inputs
                 + width * h  # qkv's input
                 + width * 3 * h  # qkv's output (v, and q and k before RoPE, are views of it)
                 + (width * 2 * h if model_config.position_encoding == "rope" else 0)  # q and k rotated
                 + width * h  # attention's output, wo's input
                 + width * h)  # the MLP's input
    if model_config.activation == "swiglu" and mlp_kernels == "quack":
        # w12's output (gate, up) only: QuACK's second GEMM recomputes silu(gate) * up from it in the backward
        # (quack-kernels 0.6.5, quack/linear.py: DActLinearFunc keeps the pre-activation, not its input)
        per_layer += width * 2 * f
    elif model_config.activation == "swiglu" and mlp_kernels == "liger":
        # w12's output, which Liger's fused SwiGLU keeps to recompute silu(gate) (liger_kernel/ops/swiglu.py,
        # 0.8.5), and silu(gate) * up, w3's input
        per_layer += width * (2 * f + f)
    elif model_config.activation == "swiglu":
        per_layer += width * (2 * f + f + f)  # w12's output (gate, up), silu(gate), silu(gate) * up: w3's input
    else:
        per_layer += width * (f + f)  # w12's output, gelu of it: w3's input
    encoder = tokens * (model_config.num_hidden_layers * per_layer + residual * h)  # + the final norm's input
    vocab = model_config.vocab_size
    if fused_loss:
        # Liger's fused linear cross-entropy makes the logits chunk by chunk and drops them; it keeps the gradients
        # it computed in the forward: its input's (the final norm's output, residual width) and a float32 one of the
        # decoder's weight and bias.
        return encoder + scored_rows * residual * h + 4 * vocab * (h + 1)
    # The head: the decoder's input and the float32 log-probabilities the loss keeps; at the log-softmax's backward,
    # the head's peak, also their float32 gradient and the one it makes of the logits (two float32 vocabulary-wide
    # rows beyond what is kept: tests/test_preflight.py measures that peak on a CPU).
    head = scored_rows * (width * h + 4 * vocab + 8 * vocab)
    return encoder + head


def config_activation_bytes(config: PretrainConfig, model_config) -> float:
    """`activation_bytes` of a pretraining config on its GPUs: its micro-batch, precision and masked rows (at the
    run's highest masking rate, its schedule included: the peak)."""
    tokens = config.trainer.micro_batch_size * config.data.max_length
    scored = tokens * (config.masking.highest_rate if config.model.masked_only_logits else 1.0)
    precision = activation_precision(config)
    return activation_bytes(model_config, tokens, precision, scored, fused_loss_runs(config, model_config),
                            mlp_kernels_that_run(config, model_config, precision))


def mlp_kernels_that_run(config: PretrainConfig, model_config, precision: str) -> str:
    """What runs the MLP on the run's GPUs: QuACK's GEMMs in 16-bit computation (in float32 it runs eager), Liger's
    SwiGLU in an eager model (compiled, Inductor's kernels run), else PyTorch's ops (what Inductor keeps is counted as
    eager's)."""
    if model_config.kernels == "quack" and in_16_bits(precision):
        return "quack"
    if model_config.kernels == "liger" and not config.model.compile:
        return "liger"
    return "eager"


def in_16_bits(precision: str) -> bool:
    """Whether a Lightning precision computes its matmuls in bf16 or fp16 (bf16-mixed, bf16-true, 16-mixed, ...)."""
    return precision.startswith(("bf16", "16"))


def activation_precision(config: PretrainConfig) -> str:
    """The precision whose widths the run's activations have on its GPUs. A mixed precision whose strategy computes
    with 16-bit weights (`loop_dtypes`: DeepSpeed's engine casts the module, FSDP2 under bf16-mixed gathers bf16
    parameters) has no float32 residual stream or norm input (the norm of a bf16 input with a bf16 weight runs in
    bf16 under autocast too, neobert.model.layers.RMSNorm): *-true's widths."""
    precision = resolve_precision_on_gpu(config)
    weights, _ = loop_dtypes(config.trainer.strategy, precision)
    if precision.endswith("-mixed") and weights != torch.float32:
        return precision.replace("mixed", "true")
    return precision


def fused_loss_runs(config: PretrainConfig, model_config) -> bool:
    """Whether the training step's MLM loss runs as Liger's fused linear cross-entropy: fused_mlm_loss asks for it,
    and the model takes it on its masked-row paths only (model.masked_only_logits), outside a compiled graph (the
    whole forward compiled, compile_scope=model, fuses the head its own way)."""
    whole_compiled = config.model.compile and config.model.compile_scope == "model"
    return model_config.fused_mlm_loss and config.model.masked_only_logits and not whole_compiled


def phases_section(report: Preflight, config: PretrainConfig, model_config) -> None:
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
        activations = config_activation_bytes(c, model_config)
        report.add(f"  activations (estimate, as above): {activations / GiB:.1f} GiB per GPU")


def resolve_precision_on_gpu(config: PretrainConfig) -> str:
    """The precision the run will have on its GPUs (null = bf16-mixed there), whatever this machine has."""
    return str(config.trainer.precision) if config.trainer.precision is not None else "bf16-mixed"


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


def memory_section(report: Preflight, config: PretrainConfig, model, parameters: int, gpu: str) -> float:
    """Reports the memory per GPU; returns the estimated total in bytes (model states plus activations)."""
    trainer = config.trainer
    world, per_node = world_size(config), trainer.num_devices
    report.section("Memory per GPU")
    if is_deepspeed(trainer.strategy):
        # DeepSpeed's own estimators (deepspeed.runtime.zero), imported here: deepspeed is a GPU extra. Stage 1 has
        # none of its own: ZeRO-2's (its partitioned float32 states; the 16-bit weights and gradients whole)
        stage = 3 if trainer.strategy.startswith("deepspeed_stage_3") else 2
        estimator = (f"ZeRO-{stage} estimator" if not trainer.strategy.startswith("deepspeed_stage_1") else
                     "ZeRO-2 estimator, for stage 1")
        offload = "offload" in trainer.strategy
        if stage == 3:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs  # a GPU extra

            largest = max(sum(p.numel() for p in block.parameters()) for block in model.model.transformer_encoder)
            largest = max(largest, model.decoder.weight.numel())
            _, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(parameters, largest, per_node, trainer.num_nodes,
                                                                   cpu_offload=offload, cpu_offload_params=offload)
        else:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs  # a GPU extra

            _, gpu_bytes = estimate_zero2_model_states_mem_needs(parameters, per_node, trainer.num_nodes,
                                                                 cpu_offload=offload)
        report.add(f"- model states (DeepSpeed's {estimator}, {world} GPUs"
                   f"{', optimizer offloaded to CPU' if offload else ''}): {gpu_bytes / GiB:.2f} GiB")
    elif trainer.strategy == "fsdp2":
        gpu_bytes = 16 * parameters / world + 2 * 2 * max(
            sum(p.numel() for p in block.parameters()) for block in model.model.transformer_encoder)
        report.add(f"- model states (FSDP2: fp32 weights, gradients and Adam moments sharded over {world}, plus two "
                   f"gathered bf16 blocks): {gpu_bytes / GiB:.2f} GiB")
    else:  # weights, gradients and Adam's two moments in the weights' dtype (*-true: 16-bit; *-mixed: float32)
        width = loop_dtypes(trainer.strategy, resolve_precision_on_gpu(config))[0].itemsize
        # torch-optimi's StableAdamW keeps a Kahan compensation of 16-bit weights (its kahan_sum default)
        kahan = config.optimizer.name == "stable_adamw" and width == 2
        weights = "fp32" if width == 4 else "16-bit"
        if config.optimizer.name == "muon":  # one momentum on the hidden matrices (muon_split), AdamW's two elsewhere
            hidden = sum(p.numel() for p in muon_split(model)[0].values())
            gpu_bytes = width * (2 * parameters + 2 * (parameters - hidden) + hidden)
            report.add(f"- model states (replicated: {weights} weights, gradients, "
                       f"Muon's momentum on the {hidden / 1e6:.1f}M parameters of the hidden matrices, AdamW's two "
                       f"moments on the other {(parameters - hidden) / 1e6:.1f}M): {gpu_bytes / GiB:.2f} GiB")
        else:
            gpu_bytes = (4 + kahan) * width * parameters
            report.add(f"- model states (replicated: {weights} weights, gradients, Adam "
                       f"moments{', Kahan compensation' if kahan else ''} = {(4 + kahan) * width} bytes/parameter): "
                       f"{gpu_bytes / GiB:.2f} GiB")
    if trainer.ema.decay:  # neobert.lit.ema: a float32 copy of the weights on every GPU
        report.add(f"- EMA of the weights (trainer.ema, float32): {4 * parameters / GiB:.2f} GiB")
        gpu_bytes += 4 * parameters
    tokens = trainer.micro_batch_size * config.data.max_length
    activations = config_activation_bytes(config, model.config)
    precision, widths = resolve_precision_on_gpu(config), activation_precision(config)
    arithmetic = precision if widths == precision else f"{precision}, {widths}'s widths under {trainer.strategy}"
    report.add(f"- activations (what each op keeps for the backward, {tokens:,} tokens per micro-batch, "
               f"{arithmetic}, the MLM head included): {activations / GiB:.1f} GiB")
    total = gpu_bytes + activations
    capacity = next((size for key, size in GPU_MEMORY_GIB.items() if key in gpu.lower()), None)
    report.add(f"- total about {total / GiB:.1f} GiB" + (f" of the {capacity} GiB of a {gpu}" if capacity else ""))
    if capacity is None:
        report.unchecked.append(f"the memory against the GPU's ({gpu!r} is none of the GPUs whose memory it knows: "
                                f"{', '.join(GPU_MEMORY_GIB).upper()})")
    if capacity and total > 0.9 * capacity * GiB:
        report.warnings.append(f"memory: about {total / GiB:.0f} GiB per GPU against {capacity} GiB: lower "
                               f"trainer.micro_batch_size and raise trainer.accumulate_grad_batches")
    return total


# The compute capability's major version of the GPUs FlashAttention 4 was written for, by a word of their name
# (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", "NVIDIA B200")
GPU_GENERATIONS = {"h100": 9, "h200": 9, "h800": 9, "h20": 9, "gh200": 9, "b100": 10, "b200": 10, "gb200": 10}


def gpu_generation(gpu: str) -> int | None:
    """The compute capability's major version of a GPU named `gpu` (GPU_GENERATIONS), None where not listed."""
    return next((generation for word in gpu.lower().split() if (generation := GPU_GENERATIONS.get(word))), None)


def attention_section(report: Preflight, config: PretrainConfig, model_config, precision: str,
                      gpu: str = DEFAULT_GPU) -> None:
    """The attention kernel of the training step: `auto` decides it on the GPU it runs on, so a preflight on a
    machine without one names what this machine's packages give, and what `gpu` would take instead."""
    report.section("Attention kernel")
    # The dtype attention computes in: bf16 under bf16-mixed autocast and bf16-true, else what the weights are.
    dtype = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16,
             "16-true": torch.float16}.get(precision, torch.float32)
    generation = gpu_generation(gpu)
    target = (gpu, generation) if generation is not None and not torch.cuda.is_available() else None
    try:
        kernel = training_attention_kernel(config.data.packing, model_config.attention_backend, "cuda",
                                           unpad=config.data.unpad, dtype=dtype, dropout=model_config.dropout,
                                           kernel=model_config.attention_kernel, head_dim=model_config.head_dim,
                                           target_gpu=target)
    except ValueError as err:  # the chosen attention kernel cannot take this step's precision or dropout
        report.refuse("model.overrides.attention_kernel", str(err))
        return
    report.add(f"- {kernel}")
    if "attention_backend" in config.derived_model_overrides():
        origin = ("derived from the data: its batches carry cu_seqlens (data.packing, data.unpad); "
                  "model.overrides.attention_backend sets another")
    elif "attention_backend" in config.model.overrides:
        origin = "model.overrides.attention_backend"
    else:
        origin = f"model.preset {config.model.preset}'s"
    report.add(f"- the model's attention_backend: {model_config.attention_backend} ({origin})")


def kernels_section(report: Preflight, config: PretrainConfig, model_config) -> None:
    """What runs the encoder's elementwise work and the MLM loss (model.overrides.kernels and fused_mlm_loss), and
    what torch.compile compiles (model.compile, compile_scope, compile_mode): docs/pretraining.md, "The model's
    kernels"."""
    report.section("Kernels and compilation")
    compiled, scope, mode = config.model.compile, config.model.compile_scope, config.model.compile_mode
    liger = model_config.kernels == "liger"
    if compiled:
        cuda_graphs = " (CUDA graphs: one batch shape, data.static_shapes)" if mode in CUDA_GRAPH_MODES else ""
        shared = "one shared graph, but the first block's" if mode in CUDA_GRAPH_MODES else "one shared graph"
        covered = f"each encoder block on its own ({shared})" if scope == "blocks" else "the whole forward"
        report.add(f"- torch.compile, mode {mode}{cuda_graphs}: {covered}")
    blocks = ("Inductor's fused kernels" if compiled else
              "Liger-Kernel's RMSNorm and fused SwiGLU" if liger else "PyTorch's eager ops")
    # The estimate's rule (`mlp_kernels_that_run`), so that the text names what the memory estimate counted
    precision = activation_precision(config)
    if mlp_kernels_that_run(config, model_config, precision) == "quack" \
            and model_config.activation == "swiglu":  # the GELU MLP stays eager
        report.add(f"- the MLP: QuACK's GEMMs, SwiGLU in their epilogues; norms and RoPE: {blocks}")
    else:
        report.add(f"- norms, SwiGLU, RoPE in the blocks: {blocks}" + (" (RoPE: ours)" if liger and not compiled
                                                                        else ""))
        if model_config.kernels == "quack":
            why = ("QuACK's MLP is a SwiGLU one; this model's is GELU" if model_config.activation != "swiglu" else
                   f"QuACK's GEMMs compute in bf16 or fp16 only, and this run computes in {precision} "
                   f"(trainer.precision)")
            report.add(f"- model.overrides.kernels=quack does not apply: {why}")
    if compiled and scope == "model":
        head = "compiled with the forward (Inductor)"
    elif fused_loss_runs(config, model_config):
        head = ("Liger's fused linear cross-entropy: no logits kept for the backward, one host read per micro-batch "
                "(the count of scored rows)")
    elif compiled and config.model.masked_only_logits:  # blocks: NeoBERTForMaskedLM.compile_masked_scoring
        head = ("the decoder at the masked rows and PyTorch's cross-entropy, compiled on their own (Inductor: the "
                "float32 log-probabilities fused, not written out; dynamic in the number of rows but under CUDA "
                "graphs, whose batches have one shape; never CUDA graphs itself)")
    else:
        rows = "the masked rows" if config.model.masked_only_logits else "every position"
        head = f"the decoder at {rows}, then PyTorch's cross-entropy (float32 log-probabilities kept)"
    if model_config.fused_mlm_loss and not fused_loss_runs(config, model_config):
        head += ("; fused_mlm_loss does not apply: it fuses masked-only logits (model.masked_only_logits) outside a "
                 "whole-forward compile")
    if model_config.decoder_pad_multiple > 1 and not fused_loss_runs(config, model_config):  # fused: the weight as is
        head += f"; the decoder's matmul on {model_config.decoder_rows:,} rows (model.overrides.decoder_pad_multiple)"
    report.add(f"- the MLM head's loss: {head}")


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
        report.unchecked.append(f"the MFU, the cost and the data workers' pace (no peak FLOP/s known for {gpu!r}); "
                                f"nor whether its kernels and precision run on it")
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
