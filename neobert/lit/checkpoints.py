"""Lightning checkpoints written by this suite: reading them (a `.ckpt` file, or a DeepSpeed checkpoint
directory), and the weights of the module's `model` inside them.

Besides Lightning's own entries, our pretraining checkpoints carry `CHECKPOINT_KEY`: the model config (hub
dict), the tokenizer name and the run config, so that a checkpoint alone can be exported.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from neobert.model.checkpoint import submodule_state

CHECKPOINT_KEY = "neobert"


def read_lightning_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():  # DeepSpeed: gather the ZeRO partitions into one fp32 state dict
        # Imported here: it imports deepspeed, an optional GPU dependency.
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        with tempfile.TemporaryDirectory() as tmp:
            convert_zero_checkpoint_to_fp32_state_dict(str(path), f"{tmp}/model.ckpt")
            return torch.load(f"{tmp}/model.ckpt", map_location="cpu", weights_only=False)
    try:
        # Our own checkpoints: trusted files that also hold plain-Python loop and data state.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(f"{path} is not a readable checkpoint (corrupt or truncated?): {err}") from err


def model_state_dict(checkpoint: dict, source: str) -> dict:
    """The weights of the LightningModule's `model` attribute (keys without `model.`)."""
    state = checkpoint.get("state_dict") or checkpoint.get("module")
    if state is None:
        raise ValueError(f"{source} has no state_dict: not a Lightning checkpoint")
    return submodule_state(state, "model.")
