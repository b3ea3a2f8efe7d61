"""Training checkpoints of the official NeoBERT repository (a plain `state_dict.pt`, optionally with DDP or
torch.compile prefixes, or DeepSpeed's `module` wrapper), converted to the hub layout."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from neobert.model.checkpoint import load_state_dict_strict
from neobert.model.config import NeoBERTConfig
from neobert.model.modeling import NeoBERTForMaskedLM

_OFFICIAL_RENAMES = [
    (re.compile(r"^(module\.|_orig_mod\.)+"), ""),  # DDP / torch.compile wrappers
    (re.compile(r"\.ffn\.0\.weight$"), ".ffn.w12.weight"),  # the official code's non-xFormers SwiGLU
    (re.compile(r"\.ffn\.2\.weight$"), ".ffn.w3.weight"),
]


def convert_official_state_dict(
    state_dict_path: str | os.PathLike, config: NeoBERTConfig, output_dir: str | os.PathLike, tokenizer=None
):
    """Converts a training checkpoint of the official repo (a plain `state_dict.pt`) to the hub layout."""
    path = Path(state_dict_path)
    if not path.is_file():
        raise FileNotFoundError(f"official state dict {path} is missing")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise ValueError(f"{path} is not a readable torch state dict: {err}") from err
    if isinstance(raw, dict) and "module" in raw and isinstance(raw["module"], dict):
        raw = raw["module"]  # DeepSpeed's model-states file
    state = {}
    for key, tensor in raw.items():
        for pattern, replacement in _OFFICIAL_RENAMES:
            key = pattern.sub(replacement, key)
        state[key] = tensor
    model = NeoBERTForMaskedLM(config)
    load_state_dict_strict(model, state, source=str(path))
    model.save_pretrained(output_dir, tokenizer=tokenizer)
    return model
