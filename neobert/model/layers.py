"""The encoder's layers below the block: the SwiGLU and GELU MLPs and the norms (RMSNorm with its bf16 path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neobert.model.config import NeoBERTConfig
from neobert.model.kernels import liger_rms_norm, liger_swiglu, quack_swiglu_mlp, use_liger, use_quack


class SwiGLU(nn.Module):
    """w3(silu(x W1) * x W2) with W1 and W2 stacked in `w12` (first half gate, second half up). `kernels`: see
    neobert.model.kernels."""

    def __init__(self, hidden: int, ffn_hidden: int, kernels: str = "eager"):
        super().__init__()
        self.w12 = nn.Linear(hidden, 2 * ffn_hidden, bias=False)
        self.w3 = nn.Linear(ffn_hidden, hidden, bias=False)
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        if use_quack(self.kernels, x, (self.w3.out_features, self.w3.in_features)):
            return quack_swiglu_mlp(x, self.w12.weight, self.w3.weight)
        gate_up = self.w12(x)
        if use_liger(self.kernels, gate_up):  # `mlp_kernel`'s Liger rule
            return self.w3(liger_swiglu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        if gate.requires_grad:  # False under no_grad / inference_mode: nothing is recorded
            return self.w3(F.silu(gate) * up)
        # No autograd: in place, in w12's output. Two fresh activations fewer spares their first-touch page faults,
        # most of this elementwise work's time in fp32 on CPU.
        return self.w3(F.silu(gate, inplace=True).mul_(up))


class GeluMLP(nn.Module):
    """The BERT MLP (ablation M0), with the same parameter names as SwiGLU: `w12` in, `w3` out."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.w12 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w3 = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w3(F.gelu(self.w12(x)))


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm`, the official code's norm: its float32 path is unchanged (bit for bit), and so is the compiled one
    (Inductor fuses it). On CUDA it is PyTorch's fused RMSNorm in every dtype (`F.rms_norm` -> aten::_fused_rms_norm:
    one kernel each way, float32 accumulation); with x and the weight both 16-bit it runs in their dtype under
    autocast too. In eager bf16/fp16 on a CPU, where F.rms_norm copies x to float32 and back, it is
    `rms_norm_in_dtype` (docs/benchmarks.md). `kernels`: see neobert.model.kernels (Liger's kernel when x and the
    weight share a dtype)."""

    def __init__(self, hidden: int, eps: float | None = None, kernels: str = "eager"):
        super().__init__(hidden, eps=eps)
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        if use_liger(self.kernels, x) and x.dtype == self.weight.dtype:
            return liger_rms_norm(x, self.weight, eps)
        if x.dtype not in (torch.bfloat16, torch.float16) or self.weight.dtype != x.dtype \
                or torch.compiler.is_compiling():
            return super().forward(x)
        if not x.is_cuda:
            return rms_norm_in_dtype(x, self.weight, eps)
        if torch.is_autocast_enabled("cuda"):
            # 16-bit weights under autocast (FSDP2's bf16 parameters): autocast would hand the kernel a float32 copy
            # of x (rms_norm is on its float32 list), keep that for the backward and return float32, a cast each way
            # around a kernel that accumulates in float32 anyway.
            with torch.autocast("cuda", enabled=False):
                return super().forward(x)
        return super().forward(x)


def rms_norm_in_dtype(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of a bf16/fp16 x without a float32 copy of it: the mean square accumulates in float32 inside the
    reduction, which reads x once (asking it for a float32 result would first copy x to float32), and x is scaled in
    its own dtype: one read and two elementwise passes. Only the per-token scale is rounded to x's dtype, off by at
    most half an ulp, as the output's own rounding is. The eager CPU path (a chain of kernels on a GPU, where
    PyTorch's fused kernel does it in one)."""
    mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).float().square() / x.shape[-1]
    normed = x * torch.rsqrt(mean_square + eps).to(x.dtype)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return normed * weight  # autograd needs `normed` for the weight's gradient
    return normed.mul_(weight)


def make_norm(config: NeoBERTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.hidden_size, eps=config.norm_eps, kernels=config.kernels)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
