"""Fused GPU kernels for the encoder's elementwise work, chosen by `NeoBERTConfig.kernels` (what each is worth on which
GPU: docs/benchmarks.md).

* ``eager``: PyTorch's own ops, the reference (and what `torch.compile` fuses by itself).
* ``liger``: Liger-Kernel's Triton kernels (`pip install liger-kernel`) for RMSNorm and SwiGLU on CUDA tensors: one
  kernel forward and one backward each, where eager runs a chain of elementwise kernels over the activations.
  CPU tensors, LayerNorm and GELU (the ablation presets) and a model being compiled stay eager.
* ``quack``: QuACK's MLP (Dao-AILab's CuTe DSL GEMMs, `pip install quack-kernels`; flash-attn-4 brings it) on CUDA
  tensors: SwiGLU computed in the first GEMM's epilogue forward and its gradient in the backward GEMM's, so that the
  2 x 2,048-wide activation gets no elementwise pass of its own. Compiled graphs included: QuACK's GEMMs are
  torch.library custom ops that Dynamo traces. It pays in compiled inference, not in training. The norms stay
  PyTorch's fused kernel; CPU tensors, float32 computation and GELU stay eager (`use_quack`).

`NeoBERTConfig.fused_mlm_loss` (either choice): in training, the MLM head's decoder and cross-entropy run as Liger's
fused linear cross-entropy: the logits of the masked rows (rows x 30,522) are made chunk by chunk and dropped, never
kept for the backward; the gradients are computed in the forward, and the argmax of each row comes out for the
training accuracy. It saves memory, not time.

RoPE stays ours under every choice: Liger rotates the two halves of a head vector (Llama's layout), NeoBERT rotates
adjacent pairs (the released checkpoint's layout); the two agree only after permuting q and k, which costs the copy
a fused kernel would save.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

import torch
from packaging.version import Version
from torch import Tensor

from neobert.model.attention import chosen_packed_kernel, cuda_capability

LIGER_MINIMUM = "0.8.2"
# torch.compile's modes that record CUDA graphs (torch._inductor.list_mode_options: triton.cudagraphs), and each one
# without them. The pretraining schema states the same modes for its checks (tests/test_compile_mode.py ties them)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def liger_missing_reason() -> str | None:
    """Why Liger-Kernel cannot be used here (None when it can be imported)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "needs the liger-kernel package (pip install liger-kernel; it runs on CUDA GPUs only)"
    if not triton_installed():
        return "needs Triton (installed with PyTorch's CUDA builds; Liger-Kernel's kernels are Triton kernels)"
    # 0.8 added the fused loss's argmax output, which the training accuracy reads (fused_mlm_loss), and 0.8.2 the
    # fused gate-up SwiGLU (LigerFusedGateUpSiLUMulFunction, kernels=liger); one minimum for either switch, as both
    # import the same package
    return older_than("liger-kernel", LIGER_MINIMUM)


def triton_installed() -> bool:
    """Whether Triton is installed: the language of Inductor's GPU kernels and of Liger-Kernel's."""
    return importlib.util.find_spec("triton") is not None


# From Hopper on, the training step compiled outran eager (H200, docs/benchmarks.md); before it the suite has no
# measurement that says compiling pays, so auto stays eager there
COMPILE_PAYS_FROM = (9, 0)


def eager_reason(device_type: str, capability: tuple[int, int] | None = None,
                 triton: bool | None = None) -> str | None:
    """Why `model.compile=auto` trains eager on `device_type` (a GPU of this compute capability; None: this one) with
    Triton or without (None: whether it is installed here), or None where it compiles (`compile_pays`)."""
    if device_type != "cuda":
        return f"a {device_type} device (auto compiles on CUDA GPUs of compute capability 9.0, Hopper, or later)"
    major, minor = cuda_capability() if capability is None else capability
    if (major, minor) < COMPILE_PAYS_FROM:
        return f"compute capability {major}.{minor}, before Hopper's 9.0"
    if not (triton_installed() if triton is None else triton):
        return "Triton is not installed (Inductor writes its GPU kernels in it; PyTorch's CUDA wheels bring it)"
    return None


def compile_pays(device_type: str, capability: tuple[int, int] | None = None, triton: bool | None = None) -> bool:
    """Whether `model.compile=auto` compiles a training step on `device_type` (a GPU of this compute capability;
    None: this one): on CUDA from Hopper (9.0) on, with Triton (None: installed here)."""
    return eager_reason(device_type, capability, triton) is None


QUACK_MINIMUM = "0.6"  # mlp_func's concat_layout, which reads w12's [gate; up] stacking as it is (0.6.5 tested)


def quack_missing_reason() -> str | None:
    """Why QuACK's MLP cannot be asked for here (None when the package is installed, recent enough)."""
    if importlib.util.find_spec("quack") is None:
        return ("needs the quack-kernels package (pip install quack-kernels, or the fa4 extra, which brings it; its "
                "kernels run on Hopper and Blackwell GPUs)")
    return older_than("quack-kernels", QUACK_MINIMUM)


def older_than(distribution: str, minimum: str) -> str | None:
    """Why the installed `distribution` is too old (a version before `minimum`, PEP 440's order), or None: recent
    enough, or importable without its metadata (a source tree on the path)."""
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if Version(installed) < Version(minimum):
        return f"needs {distribution} >= {minimum} (installed: {installed}; pip install -U {distribution})"
    return None


@dataclass(frozen=True)
class KernelPlan:
    """Which kernels a step of a NeoBERT model runs on one device: the model's own answer (`kernel_plan`), which its
    forward pass follows layer by layer and the preflight reports for a GPU it may not be running on."""

    attention: str  # a packed batch's kernel (`chosen_packed_kernel`), or "sdpa" for padded batches (a mask)
    mlp: str  # "quack", "liger" or "eager" (`mlp_kernel`)
    norms: str  # "liger" or "eager" (`liger_runs`)
    fused_loss: bool  # the MLM head's decoder and loss as Liger's fused linear cross-entropy (`fuses_mlm_loss`)


def kernel_plan(config, device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None = None, *,
                packed: bool = True, training: bool = True, compile_scope: str | None = None,
                masked_only: bool = True) -> KernelPlan:
    """The kernels of a step of a model of this NeoBERTConfig on `device_type` computing in `dtype` (autocast's, or
    the weights'), on a GPU of this compute `capability` (None: the current device's), over packed (cu_seqlens) or
    padded batches, with gradients (`training`), compiled whole ("model"), block by block ("blocks") or not (None),
    scoring the masked rows only. A ValueError naming the field where the chosen attention kernel cannot run."""
    attention = "sdpa"
    if packed:
        attention = chosen_packed_kernel(config.attention_kernel, device_type, dtype,
                                         config.dropout if training else 0.0, config.head_dim, training, capability)
    blocks_compiled = compile_scope is not None
    mlp = "eager"
    if config.activation == "swiglu":  # the GELU MLP has no fused kernel
        mlp = mlp_kernel(config.kernels, device_type, dtype, (config.hidden_size, config.ffn_hidden_size),
                         blocks_compiled, capability)
    liger_norms = config.norm == "rmsnorm" and liger_runs(config.kernels, device_type, blocks_compiled)
    norms = "liger" if liger_norms else "eager"
    fused = masked_only and fuses_mlm_loss(config.fused_mlm_loss, device_type, training, compile_scope == "model")
    return KernelPlan(attention, mlp, norms, fused)


def mlp_kernel(kernels: str, device_type: str, dtype: torch.dtype, widths: tuple[int, int], compiling: bool,
               capability: tuple[int, int] | None = None) -> str:
    """What runs a SwiGLU MLP of these (hidden, FFN) `widths`: QuACK's GEMMs where asked for and `quack_takes` it
    (compiled or not), Liger's SwiGLU where `liger_runs` (on CUDA tensors only), else "eager"."""
    if kernels == "quack" and device_type == "cuda" and quack_takes(dtype, widths, capability):
        return "quack"
    return "liger" if liger_runs(kernels, device_type, compiling) else "eager"


def liger_runs(kernels: str, device_type: str, compiling: bool) -> bool:
    """Whether Liger's kernels run a layer (an RMSNorm, the SwiGLU): asked for, on CUDA tensors, outside a compiled
    graph (where Inductor fuses the eager ops itself)."""
    return kernels == "liger" and device_type == "cuda" and not compiling


def fuses_mlm_loss(fused_mlm_loss: bool, device_type: str, backward: bool, compiling: bool) -> bool:
    """Whether the MLM head's masked rows run their decoder and loss as one fused kernel: asked for, on a GPU, only
    where a backward follows (the kernel computes the gradients in the forward; evaluation wants the logits), outside
    a compiled graph (a whole-forward compile fuses the head its own way)."""
    return fused_mlm_loss and device_type == "cuda" and backward and not compiling


def use_quack(kernels: str, x: Tensor, widths: tuple[int, int]) -> bool:
    """Whether the MLP (hidden and FFN `widths`) runs QuACK's GEMMs on x, compiled or not: `mlp_kernel`'s answer for
    x's computation (its dtype, or CUDA autocast's), with its last dimension contiguous. Elsewhere the eager MLP."""
    if kernels != "quack" or not x.is_cuda:
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return x.stride(-1) == 1 and mlp_kernel(kernels, "cuda", dtype, widths, torch.compiler.is_compiling()) == "quack"


def quack_takes(dtype: torch.dtype, widths: tuple[int, int], capability: tuple[int, int] | None = None) -> bool:
    """Whether QuACK's GEMMs run an MLP of these widths computed in `dtype` on a GPU of this compute capability (None:
    this one): bf16 or fp16 (QuACK has no float32 GEMM on Hopper, and makes it TF32 on Blackwell), both widths
    multiples of 8 (what QuACK's own MLP module asks before taking its GEMMs), compute capability 8.0 or later."""
    # the major version alone: torch 2.11's Dynamo cannot compare the capability's tuple (it raised in every compiled
    # block of kernels="quack")
    major = (cuda_capability() if capability is None else capability)[0]
    return dtype in (torch.bfloat16, torch.float16) and all(width % 8 == 0 for width in widths) and major >= 8


def quack_swiglu_mlp(x: Tensor, w12: Tensor, w3: Tensor) -> Tensor:
    """w3(silu(x W1) * x W2) with W1 and W2 stacked in `w12` (gate first) as QuACK's two GEMMs, SwiGLU in their
    epilogues; under autocast in its dtype. Untuned (tuned=False: the default tile of the GPU's generation): QuACK's
    autotuner compiles dozens of configurations per GEMM shape, minutes each."""
    from quack.mlp import mlp_func  # optional, GPU-only (see liger_rms_norm)

    return mlp_func(x, w12, w3, "swiglu", tuned=False, concat_layout=True)


def use_liger(kernels: str, x: Tensor) -> bool:
    """Whether a layer runs Liger's kernel on x (`liger_runs`)."""
    return liger_runs(kernels, "cuda" if x.is_cuda else x.device.type, torch.compiler.is_compiling())


def liger_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in one kernel each way. Casting "llama": the inverse RMS in float32, x scaled in its own dtype and then
    multiplied by the weight, the arithmetic of `neobert.model.layers.rms_norm_in_dtype` (the eager CUDA path,
    PyTorch's fused kernel, rounds once). in_place=False: the incoming gradient is left intact (a residual branch may
    still read it)."""
    # Liger-Kernel is optional and GPU-only: imported where it is used.
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)


def liger_swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up from the stacked projection (gate first, as `w12` is laid out), read in place: no chunked
    copies. in_place=True: the backward writes its gradient over `gate_up`, which nothing else reads (w12's own
    backward needs its input, not its output); a second backward through the same graph is refused by Liger."""
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction  # optional, GPU-only (see above)

    # Rows of one token each: Liger's backward returns the gradient in that 2-D shape, whatever the input's.
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    return LigerFusedGateUpSiLUMulFunction.apply(rows, True).view(*gate_up.shape[:-1], -1)


def liger_linear_cross_entropy(rows: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                               ignore_index: int) -> tuple[Tensor, Tensor]:
    """(the summed cross-entropy of rows @ weight.T + bias against `targets`, each row's argmax token) without the
    logits: Liger's fused linear cross-entropy, chunk by chunk. Rows whose target is `ignore_index` count for nothing
    (their prediction is -1). reduction="sum": the caller divides by its own count, so that a batch with nothing to
    score gives 0, as the eager head does. Liger reads the number of scored rows on the host (one device sync per
    call) and under autocast runs the matmuls in its dtype."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction  # optional, GPU-only

    # Positional: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
    # softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy, return_predicted_tokens.
    # accum_dtype float32: the weight's gradient is summed over the chunks in float32 even where the weights are bf16
    # (DeepSpeed's bf16), as one eager matmul would accumulate it, not rounded to bf16 after every chunk.
    loss, _, _, predictions = LigerFusedLinearCrossEntropyFunction.apply(
        rows, weight, targets, bias, None, ignore_index, 0.0, 0.0, "sum", None, False, torch.float32, False, False,
        True)
    return loss, predictions
