"""Token-based FLOP counts and model FLOP utilisation (MFU), for any encoder.

Forward FLOPs per token = 2 x (weights of the matmuls every token goes through) + 4 x layers x hidden x
sequence length (q k^T and attention x v). Training is 3x the forward (backward = 2x forward).
"""

from __future__ import annotations

import torch
from torch import nn

# Dense bf16 tensor-core peaks per device, for MFU.
PEAK_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12}


def matmul_params(model: nn.Module) -> int:
    """Weights of every nn.Linear in the model (the MLM decoder included when the model has one)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def flops_per_token(matmul_weights: float, num_layers: int, hidden_size: int, seq_len: int,
                    training: bool = False) -> float:
    """`matmul_weights`: from `matmul_params`, less what a token skips (e.g. the decoder for unmasked tokens
    when MLM logits are computed at masked positions only: subtract (1 - mask_rate) x decoder weights)."""
    forward = 2 * matmul_weights + 4 * num_layers * hidden_size * seq_len
    return 3 * forward if training else forward


def mfu(tokens_per_second: float, flops_per_tok: float, peak_flops: float) -> float:
    return tokens_per_second * flops_per_tok / peak_flops


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of a known GPU (PEAK_FLOPS, matched by name); None on CPU or an unknown device."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)
