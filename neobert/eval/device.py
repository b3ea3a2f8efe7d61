"""The device an evaluation or a measurement runs on, from a config's `device` key: auto, cpu, cuda or cuda:N."""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available")
    return torch.device(name)
