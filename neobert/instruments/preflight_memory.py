"""The preflight's memory section (neobert.instruments.preflight): model states per GPU from DeepSpeed's ZeRO
estimators or the strategy's own arithmetic, and an activation estimate, term by term, of what each op keeps for
the backward with the kernels the model's plan runs on the run's GPU."""

from __future__ import annotations

from neobert.config.pretrain import PretrainConfig
from neobert.instruments.preflight_kernels import (DEFAULT_GPU, activation_precision, in_16_bits, planned_capability,
                                                   resolve_precision_on_gpu, training_plan)
from neobert.lit.optim import muon_split
from neobert.lit.strategies import is_deepspeed, loop_dtypes

GPU_MEMORY_GIB = {"h100": 80, "h200": 141, "a100": 80}
GiB = 2**30


def world_size(config: PretrainConfig) -> int:
    return config.trainer.num_devices * config.trainer.num_nodes


def activation_bytes(model_config, tokens: int, precision: str, scored_rows: float, fused_loss: bool = False,
                     mlp_kernels: str = "eager") -> float:
    """Bytes a micro-batch of `tokens` tokens holds for its backward, term by term: what each op of the encoder keeps
    with the fused attention and norm kernels of a GPU (a norm keeps its input and a per-row scale; attention its
    inputs, output and per-row log-sum-exp), then the MLM head over its `scored_rows` (the masked tokens when only
    those are projected; with `fused_loss`, Liger's, no logits are kept). `precision` decides the widths: under mixed
    precision the residual stream (every norm's input) stays float32 and the matmuls read 16-bit copies; 16-true
    and 32-true keep one width throughout. `mlp_kernels`: what runs the SwiGLU MLP (`KernelPlan.mlp`), whose
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


def config_activation_bytes(config: PretrainConfig, model_config, gpu: str = DEFAULT_GPU) -> float:
    """`activation_bytes` of a pretraining config on its GPUs (named `gpu`): its micro-batch, precision and masked rows
    (at the run's highest masking rate, its schedule included: the peak), and the MLP kernels and MLM loss of the
    model's plan there (`training_plan`)."""
    tokens = config.trainer.micro_batch_size * config.data.max_length
    scored = tokens * (config.masking.highest_rate if config.model.masked_only_logits else 1.0)
    plan = training_plan(config, model_config, planned_capability(gpu))
    return activation_bytes(model_config, tokens, activation_precision(config), scored, plan.fused_loss, plan.mlp)


def memory_section(report, config: PretrainConfig, model, parameters: int, gpu: str) -> float:
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
    activations = config_activation_bytes(config, model.config, gpu)
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
