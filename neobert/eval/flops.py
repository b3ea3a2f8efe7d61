"""Token-based FLOP counts and model FLOP utilisation (MFU), for any encoder, and what the machine can do: GPU
peaks, and whether the CPU multiplies bfloat16 natively.

Forward FLOPs per token = 2 x (weights of the matmuls every token goes through) + 4 x layers x hidden x
sequence length (q k^T and attention x v). Training is 3x the forward (backward = 2x forward). Over a batch of
sequences of lengths n_i the attention term is 4 x layers x hidden x sum(n_i^2) (`attention_flops`): a token of a
short document attends to its document only, so pretraining's MFU counts it from the real lengths, not at
data.max_length (which overstates it for short documents: attention is ~46% of NeoBERT's forward FLOPs per token at
4,096 with masked-only logits, ~18% at 1,024).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks per device, for MFU, matched against torch.cuda.get_device_name() by the longest key
# it contains (the most specific: "h100 pcie" before "h100"). NVIDIA's datasheets give the peaks with sparsity
# (2x dense): H100 SXM 1,979 and H100 PCIe 1,513 TFLOP/s (H100 Tensor Core GPU datasheet), H200 SXM 1,979 (H200
# datasheet), A100 624 (A100 datasheet, SXM and PCIe alike). The SXM parts name themselves "NVIDIA H100 80GB HBM3"
# and "NVIDIA H200". Without a peak, so no MFU rather than a wrong one: the NVL parts ("NVIDIA H100 NVL", "NVIDIA
# H200 NVL"; lower clocks, no datasheet figure was at hand to cite), whose names contain the SXM parts' keys.
PEAK_FLOPS = {"h100 pcie": 756e12, "h100": 989e12, "h200": 989e12, "a100": 312e12}
NO_PEAK_PARTS = ("nvl",)


def matmul_params(model: nn.Module) -> int:
    """Weights of every nn.Linear that every token goes through (the MLM decoder included when the model has one);
    a pooler's left out (Hugging Face BERT's and RoBERTa's: one token per sequence)."""
    return sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and "pooler" not in name.split("."))


def flops_per_token(matmul_weights: float, num_layers: int, hidden_size: int, seq_len: int,
                    training: bool = False) -> float:
    """`matmul_weights`: from `matmul_params`, less what a token skips (e.g. the decoder for unmasked tokens
    when MLM logits are computed at masked positions only: subtract (1 - mask_rate) x decoder weights)."""
    forward = 2 * matmul_weights + 4 * num_layers * hidden_size * seq_len
    return 3 * forward if training else forward


def attention_flops(num_layers: int, hidden_size: int, squared_lengths: float, training: bool = False) -> float:
    """FLOPs of attention (q k^T and attention x v) over sequences whose squared lengths sum to `squared_lengths`
    (BatchBuilder's stats["squared_lengths"]): 4 x layers x hidden x sum(n_i^2), 3x that for training. With
    `flops_per_token(..., seq_len=0)` for the matmuls: a batch's FLOPs = tokens x that + this."""
    forward = 4 * num_layers * hidden_size * squared_lengths
    return 3 * forward if training else forward


def mfu(tokens_per_second: float, flops_per_tok: float, peak_flops: float) -> float:
    return tokens_per_second * flops_per_tok / peak_flops


def peak_flops(device: torch.device, compute_dtype: torch.dtype) -> float | None:
    """The dense bf16 peak of a known GPU (`peak_flops_of` its name) for 16-bit computation; None on CPU, on an
    unknown device, and for float32 or float64 computation (no MFU against a tensor-core rate it does not run at)."""
    if device.type != "cuda" or compute_dtype not in (torch.bfloat16, torch.float16):
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (torch.cuda.get_device_name), PEAK_FLOPS's longest key in it; None
    when no key matches, or for a part of NO_PEAK_PARTS."""
    name = device_name.lower()
    if any(part in name.split() for part in NO_PEAK_PARTS):
        return None
    matches = [key for key in PEAK_FLOPS if key in name]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


# CPU flags of native bfloat16 matmuls (Linux /proc/cpuinfo names). Without them PyTorch emulates bf16, far slower
# than float32; with them bf16 is the faster (docs/benchmarks.md).
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU multiplies bfloat16 natively; None where it cannot be told (no /proc/cpuinfo)."""
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return None
    return any(flag in flags.split() for flag in NATIVE_BF16_CPU_FLAGS)


def warn_if_bf16_is_emulated(device_type: str, dtype: torch.dtype | None) -> bool:
    """Logs a warning when bfloat16 is asked for on a CPU without native bf16 (it would be far slower than float32);
    returns whether it warned."""
    if device_type != "cpu" or dtype != torch.bfloat16 or cpu_has_native_bf16() is not False:
        return False
    log.warning("bfloat16 on this CPU is emulated (no %s in /proc/cpuinfo): it is far slower than float32 here "
                "(~100x measured on an AVX2-only CPU); use float32 on this machine", " or ".join(NATIVE_BF16_CPU_FLAGS))
    return True
