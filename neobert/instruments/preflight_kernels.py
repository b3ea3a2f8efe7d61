"""The preflight's kernel sections (neobert.instruments.preflight): which attention, MLP and norm kernels, MLM loss and
compilation a pretraining run takes on its GPUs, in words. The answer is the model's own (`neobert.model.kernels`
`kernel_plan`, the rules its forward pass follows), asked for the GPU the run is planned for: this machine's where it
has one, else the capability of the GPU named by `--gpu` (GPU_CAPABILITIES)."""

from __future__ import annotations

import re

import torch

from neobert.config.pretrain import CUDA_GRAPH_MODES, PretrainConfig
from neobert.jobs.pretrain import compile_decision, decide_compile
from neobert.lit.strategies import loop_dtypes
from neobert.model import attention
from neobert.model.attention import (attention_kernel_missing_reason, before_ampere, chosen_packed_kernel,
                                     flash_attn_4_takes)
from neobert.model.kernels import KernelPlan, kernel_plan, triton_installed

DEFAULT_GPU = "NVIDIA H100 80GB HBM3"  # what torch.cuda.get_device_name() says on an H100 SXM
# The compute capability of a GPU by a word of its name (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3",
# "NVIDIA GH200 480GB", "NVIDIA B200", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce GTX 1080")
GPU_CAPABILITIES = {"h100": (9, 0), "h200": (9, 0), "h800": (9, 0), "h20": (9, 0), "gh200": (9, 0),
                    "b100": (10, 0), "b200": (10, 0), "gb200": (10, 0),
                    "a100": (8, 0), "a800": (8, 0), "a10": (8, 6), "a10g": (8, 6), "l4": (8, 9), "l40": (8, 9),
                    "l40s": (8, 9), "v100": (7, 0), "t4": (7, 5), "p100": (6, 0), "1080": (6, 1)}
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16,
                  "16-true": torch.float16}

KERNEL_WORDS = {
    "flash_attn_4": "FlashAttention 4's flash_attn_varlen_func (flash-attn-4, CuTe DSL; Hopper and Blackwell)",
    "flash_attn_3": "FlashAttention 3's flash_attn_varlen_func (flash_attn_interface, Hopper)",
    "flash_attn": "flash-attn's flash_attn_varlen_func (FlashAttention varlen)",
    "varlen_attn": "PyTorch's varlen_attn (FlashAttention varlen)",
    "xformers": "xFormers' memory_efficient_attention with a block-diagonal mask (one host read per forward)",
    "padded_sdpa": "SDPA over the documents scattered into a padded grid with a key-padding mask (correct; no "
                   "varlen kernel: on CUDA it needs bf16/fp16 on an Ampere or later GPU, and for dropout > 0 "
                   "flash-attn or xFormers)",
}


def gpu_capability(gpu: str) -> tuple[int, int] | None:
    """The compute capability of a GPU named `gpu` (GPU_CAPABILITIES), None where not listed."""
    words = re.split(r"[\s-]+", gpu.lower())
    return next((capability for word in words if (capability := GPU_CAPABILITIES.get(word))), None)


def planned_capability(gpu: str) -> tuple[int, int] | None:
    """The capability the run is planned for: None (this machine's GPU, read) where there is one, else `gpu`'s."""
    return None if torch.cuda.is_available() else gpu_capability(gpu)


def planned_run(config: PretrainConfig, capability: tuple[int, int] | None) -> PretrainConfig:
    """The config as it trains on the planned GPU (`planned_capability`): model.compile=auto decided there
    (`decide_compile`), with this machine's Triton where it has a GPU, else with the one PyTorch's CUDA build brings."""
    return decide_compile(config, "cuda", capability, planned_triton())


def planned_triton() -> bool | None:
    """Whether the planned GPU's machine has Triton: None (this machine's, looked up) where it has a GPU; else true, as
    PyTorch's CUDA build brings it."""
    return None if torch.cuda.is_available() else True


def resolve_precision_on_gpu(config: PretrainConfig) -> str:
    """The precision the run will have on its GPUs (null = bf16-mixed there), whatever this machine has."""
    return str(config.trainer.precision) if config.trainer.precision is not None else "bf16-mixed"


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


def training_plan(config: PretrainConfig, model_config, capability: tuple[int, int] | None) -> KernelPlan:
    """The model's kernel plan of the run's training step on a GPU of this capability (None: this machine's): its
    batches' layout, its precision's dtype, its compilation (model.compile=auto decided for that GPU) and masked-only
    head. A ValueError naming the field where the chosen attention kernel cannot run it."""
    data, model = config.data, planned_run(config, capability).model
    return kernel_plan(model_config, "cuda", COMPUTE_DTYPES.get(resolve_precision_on_gpu(config), torch.float32),
                       capability, packed=data.packing != "none" or data.unpad, training=True,
                       compile_scope=model.compile_scope if model.compile else None,
                       masked_only=model.masked_only_logits)


def precision_section(report, config: PretrainConfig, gpu: str) -> None:
    """bf16 on a GPU without it (before Ampere): autocast refuses it at the first step."""
    precision, capability = resolve_precision_on_gpu(config), gpu_capability(gpu)
    if precision.startswith("bf16") and capability is not None and before_ampere(capability):
        report.refuse("trainer.precision", f"{precision} computes in bfloat16, which the {gpu} (compute capability "
                                           f"{capability[0]}.{capability[1]}) does not support (it needs 8.0, Ampere, "
                                           f"or later): set trainer.precision=16-mixed or 32-true")


def attention_section(report, config: PretrainConfig, model_config, precision: str, gpu: str = DEFAULT_GPU) -> None:
    """The attention kernel of the training step: `auto` decides it on the GPU it runs on, so a preflight on a
    machine without one names what the named GPU takes with this machine's packages, and what it would take with
    others."""
    report.section("Attention kernel")
    capability = planned_capability(gpu)
    target = (gpu, capability) if capability is not None else None
    try:
        kernel = training_attention_kernel(config.data.packing, model_config.attention_backend, "cuda",
                                           unpad=config.data.unpad, dtype=COMPUTE_DTYPES.get(precision, torch.float32),
                                           dropout=model_config.dropout, kernel=model_config.attention_kernel,
                                           head_dim=model_config.head_dim, target_gpu=target)
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


def training_attention_kernel(packing: str, attention_backend: str, device_type: str, unpad: bool = True,
                              dtype: torch.dtype = torch.bfloat16, dropout: float = 0.0, kernel: str = "auto",
                              head_dim: int | None = None,
                              target_gpu: tuple[str, tuple[int, int]] | None = None) -> str:
    """In words, the attention kernel of a pretraining step (data.packing, the model's attention_backend, the device
    type, data.unpad, the compute dtype, the model's dropout, its attention_kernel and head size: a kernel's tiles
    follow it, and `auto` leaves out one that does not take it). In training the batch's layout chooses the path, not
    `attention_backend`: the step reads nothing from the device, so a padded batch is never unpadded inside.
    `target_gpu`: (name, compute capability) of the GPU a preflight on a machine without one plans for. The kernel is
    the model's (`chosen_packed_kernel`, `kernel_plan`'s attention rule). A ValueError naming the field where the
    chosen kernel cannot run the step."""
    chosen = f" (attention_kernel={kernel})" if kernel != "auto" else ""
    if packing == "none" and not unpad:
        note = " (attention_backend=varlen does not unpad it in training)" if attention_backend == "varlen" else ""
        applies = f"; attention_kernel={kernel} applies to batches with cu_seqlens only" if chosen else ""
        return ("padded batches (data.unpad=false): SDPA with a key-padding mask, so not the FlashAttention kernel "
                f"(it takes no mask), and [PAD] goes through every matmul{note}{applies}")
    layout = f"packed rows ({packing})" if packing != "none" else "unpadded documents (data.unpad)"
    capability = target_gpu[1] if target_gpu is not None else None
    picked = chosen_packed_kernel(kernel, device_type, dtype, dropout, head_dim, True, capability)
    generation = (capability or attention.cuda_capability())[0]
    if kernel == "auto" and device_type == "cuda" and dtype in COMPUTE_DTYPES.values() and dropout == 0.0:
        chosen = _other_kernels_note(picked, generation, head_dim, target_gpu)
    return f"{layout} with cu_seqlens: {KERNEL_WORDS[picked]}{chosen}"


def _other_kernels_note(picked: str, generation: int, head_dim: int | None,
                        target_gpu: tuple[str, tuple[int, int]] | None) -> str:
    """What `auto` would take instead on another GPU or with another package, where that differs from `picked` (on a
    GPU where FA4 runs but was left out, its warning said why)."""
    on_fa4_gpu = flash_attn_4_takes(generation, None)
    has_flash_attn_3 = attention_kernel_missing_reason("flash_attn_3") is None
    has_flash_attn_4 = attention_kernel_missing_reason("flash_attn_4") is None
    if has_flash_attn_3 and picked != "flash_attn_3":
        note = " (FlashAttention 3's instead on a Hopper GPU, sm90: flash_attn_3 is installed"
        return note + ("; FlashAttention 4's on a Blackwell GPU, sm100: flash-attn-4 is installed)"
                       if has_flash_attn_4 and picked != "flash_attn_4" else ")")
    if has_flash_attn_4 and picked not in ("flash_attn_3", "flash_attn_4") and not on_fa4_gpu:
        return " (FlashAttention 4's instead on a Hopper or Blackwell GPU, sm90/sm100: flash-attn-4 is installed)"
    if not has_flash_attn_4 and picked != "flash_attn_3" and on_fa4_gpu and target_gpu is None:
        return (" (on this GPU FlashAttention 4 would run it faster: pip install -e '.[fa4]'; docs/pretraining.md, "
                "\"Attention kernels\")")
    if not has_flash_attn_4 and picked != "flash_attn_3" and target_gpu is not None \
            and flash_attn_4_takes(generation, head_dim):
        return (f" (on the {target_gpu[0]}: FlashAttention 4 instead where flash-attn-4 is installed there, pip "
                "install -e '.[fa4]'; FlashAttention 3 first on sm90 where built; docs/pretraining.md, \"Attention "
                "kernels\")")
    return ""


def kernels_section(report, config: PretrainConfig, model_config, capability: tuple[int, int] | None) -> None:
    """What runs the encoder's elementwise work and the MLM loss (model.overrides.kernels and fused_mlm_loss), and
    what torch.compile compiles (model.compile, compile_scope, compile_mode), as the model's plan for the run's GPU
    says: docs/pretraining.md, "The model's kernels"."""
    report.section("Kernels and compilation")
    if config.model.compile == "auto":
        report.add(f"- {auto_compile_words(config, capability)}")
    config = planned_run(config, capability)
    compiled, scope, mode = config.model.compile, config.model.compile_scope, config.model.compile_mode
    plan = training_plan(config, model_config, capability)
    liger = plan.norms == "liger"
    if compiled:
        cuda_graphs = " (CUDA graphs: one batch shape, data.static_shapes)" if mode in CUDA_GRAPH_MODES else ""
        shared = "one shared graph, but the first block's" if mode in CUDA_GRAPH_MODES else "one shared graph"
        covered = f"each encoder block on its own ({shared})" if scope == "blocks" else "the whole forward"
        report.add(f"- torch.compile, mode {mode}{cuda_graphs}: {covered}")
    blocks = ("Inductor's fused kernels" if compiled else
              "Liger-Kernel's RMSNorm and fused SwiGLU" if liger else "PyTorch's eager ops")
    if plan.mlp == "quack":
        report.add(f"- the MLP: QuACK's GEMMs, SwiGLU in their epilogues; norms and RoPE: {blocks}")
    else:
        report.add(f"- norms, SwiGLU, RoPE in the blocks: {blocks}" + (" (RoPE: ours)" if liger else ""))
        if model_config.kernels == "quack":
            report.add(f"- model.overrides.kernels=quack does not apply: {_why_not_quack(config, model_config)}")
    report.add(f"- the MLM head's loss: {_head_words(config, model_config, plan)}")


def auto_compile_words(config: PretrainConfig, capability: tuple[int, int] | None) -> str:
    """What model.compile=auto becomes on the run's GPU (this machine's, else one of this `capability`) and why: the
    model's rule (`compile_pays`) as `planned_run` asks it."""
    if capability is None and not torch.cuda.is_available():
        return ("model.compile=auto: eager, as model.compile=false: the named GPU's compute capability is not known "
                "here (GPU_CAPABILITIES); it compiles on one of 9.0, Hopper, or later with Triton installed")
    triton = planned_triton()
    words = compile_decision(planned_run(config, capability), "cuda", capability, triton)
    if triton and not triton_installed():
        words += " (there: PyTorch's CUDA build brings Triton; this machine has none)"
    return words


def _why_not_quack(config: PretrainConfig, model_config) -> str:
    if model_config.activation != "swiglu":
        return "QuACK's MLP is a SwiGLU one; this model's is GELU"
    if model_config.hidden_size % 8 or model_config.ffn_hidden_size % 8:
        return (f"QuACK's GEMMs take widths that are multiples of 8, and this MLP's are {model_config.hidden_size} "
                f"and {model_config.ffn_hidden_size}")
    precision = activation_precision(config)
    if not in_16_bits(precision):
        return (f"QuACK's GEMMs compute in bf16 or fp16 only, and this run computes in {precision} "
                f"(trainer.precision)")
    return "QuACK's GEMMs need a GPU of compute capability 8.0 or later"


def _head_words(config: PretrainConfig, model_config, plan: KernelPlan) -> str:
    compiled, scope = config.model.compile, config.model.compile_scope
    if compiled and scope == "model":
        head = "compiled with the forward (Inductor)"
    elif plan.fused_loss:
        head = ("Liger's fused linear cross-entropy: no logits kept for the backward, one host read per micro-batch "
                "(the count of scored rows)")
    elif compiled and config.model.masked_only_logits:  # blocks: NeoBERTForMaskedLM.compile_masked_scoring
        head = ("the decoder at the masked rows and PyTorch's cross-entropy, compiled on their own (Inductor: the "
                "float32 log-probabilities fused, not written out; dynamic in the number of rows but under CUDA "
                "graphs, whose batches have one shape; never CUDA graphs itself)")
    else:
        rows = "the masked rows" if config.model.masked_only_logits else "every position"
        head = f"the decoder at {rows}, then PyTorch's cross-entropy (float32 log-probabilities kept)"
    if model_config.fused_mlm_loss and not plan.fused_loss:
        head += ("; fused_mlm_loss does not apply: it fuses masked-only logits (model.masked_only_logits) outside a "
                 "whole-forward compile")
    if model_config.decoder_pad_multiple > 1 and not plan.fused_loss:  # fused: the weight as is
        head += f"; the decoder's matmul on {model_config.decoder_rows:,} rows (model.overrides.decoder_pad_multiple)"
    return head
