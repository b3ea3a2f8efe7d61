"""Exporting trained weights in the hub layout (`python -m experiments.export`), and converting the official
repository's training checkpoints (`python -m experiments.convert_official`)."""

from __future__ import annotations

import os
from pathlib import Path

from neobert.data.tokenizer import load_tokenizer
from neobert.errors import CheckpointError
from neobert.lit.checkpoints import CHECKPOINT_KEY, model_state_dict, read_lightning_checkpoint
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM, convert_official_state_dict
from neobert.model.checkpoint import load_state_dict_strict


def export_from_checkpoint(checkpoint_path: str | Path, export_dir: str | Path) -> Path:
    """A pretraining checkpoint -> the hub layout with the tokenizer beside it."""
    checkpoint = read_lightning_checkpoint(checkpoint_path)
    extra = checkpoint.get(CHECKPOINT_KEY)
    if extra is None:
        raise CheckpointError(f"{checkpoint_path} was not written by neobert's pretraining (no '{CHECKPOINT_KEY}' "
                              f"entry)")
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_hub_dict(extra["model_config"]))
    load_state_dict_strict(model, model_state_dict(checkpoint, str(checkpoint_path)), str(checkpoint_path))
    max_length = extra.get("config", {}).get("data", {}).get("max_length")
    tokenizer = load_tokenizer(extra["tokenizer"], max_length=max_length, config_key="data.tokenizer")
    model.save_pretrained(export_dir, tokenizer=tokenizer)
    return Path(export_dir)


def convert_official(state_dict: str | os.PathLike, output_dir: str | os.PathLike, preset: str = "neobert",
                     tokenizer: str = "google-bert/bert-base-uncased", **fields) -> Path:
    """The official trainer's `state_dict.pt` -> the hub layout, for a model of `preset` with `fields` changed."""
    config = NeoBERTConfig.from_preset(preset, **fields)
    convert_official_state_dict(state_dict, config, output_dir,
                                tokenizer=load_tokenizer(tokenizer, max_length=config.max_length))
    return Path(output_dir)
