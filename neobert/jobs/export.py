"""Exporting trained weights in the hub layout (`python -m experiments.export`): one checkpoint, its EMA weight
set, or the average of several checkpoints (ModernBERT's released weights average checkpoints); and converting
the official repository's training checkpoints (`python -m experiments.convert_official`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch

from neobert.data.tokenizer import load_tokenizer
from neobert.errors import CheckpointError
from neobert.layout import AVERAGING_JSON, checkpoint_dir
from neobert.lit.checkpoints import (CHECKPOINT_KEY, EMA_STATE_KEY, model_state_dict, read_lightning_checkpoint,
                                     step_checkpoints)
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM, convert_official_state_dict
from neobert.model.checkpoint import load_state_dict_strict, submodule_state
from neobert.outputs import EXPORT, claim_output_dir, replace_directory, staging_dir

WEIGHT_SETS = ("raw", "ema")
EXPORT_EXISTS = ("export directory {directory} is not empty (it holds {held}): pass --overwrite to replace it as a "
                 "whole")


def export_from_checkpoint(checkpoint_path: str | Path, export_dir: str | Path, *, weights: str = "raw",
                           average: Sequence[str | Path] = (), overwrite: bool = False) -> Path:
    """A pretraining checkpoint -> the hub layout with the tokenizer beside it. `weights="ema"` exports the
    checkpoint's EMA (trainer.ema) instead of the trained weights; `average` (checkpoint paths, see
    `select_checkpoints`) exports the mean of their weight sets, recorded in `averaging.json`. A non-empty
    `export_dir` is refused unless `overwrite`, which replaces it as a whole once the new export is complete (the
    files of two exports are never mixed: a stale averaging.json would misstate the weights); a directory holding
    the checkpoints it reads, any checkpoint or files that are not an export's is never written
    (`neobert.outputs.claim_output_dir`)."""
    if weights not in WEIGHT_SETS:
        raise CheckpointError(f"unknown weight set {weights!r}: choose one of {WEIGHT_SETS}")
    export_dir = Path(export_dir)
    sources = [Path(p) for p in average] or [Path(checkpoint_path)]
    claim_output_dir(export_dir, EXPORT, where=f"export directory {export_dir}", noun="export directory",
                     earlier=EXPORT_EXISTS, overwrite=overwrite, flag="--overwrite",
                     inputs=[(str(path), path) for path in dict.fromkeys(sources + [Path(checkpoint_path)])])
    checkpoints = [read_lightning_checkpoint(path) for path in sources]
    extra = checkpoints[0].get(CHECKPOINT_KEY)
    if extra is None:
        raise CheckpointError(f"{sources[0]} was not written by neobert's pretraining (no '{CHECKPOINT_KEY}' entry)")
    for path, checkpoint in zip(sources[1:], checkpoints[1:]):
        if (checkpoint.get(CHECKPOINT_KEY) or {}).get("model_config") != extra["model_config"]:
            raise CheckpointError(f"{path} holds another model than {sources[0]} (its model config differs): "
                                  f"only checkpoints of one run can be averaged")
    states = [weight_set(checkpoint, str(path), weights) for path, checkpoint in zip(sources, checkpoints)]
    state = average_state_dicts(states, [str(p) for p in sources]) if len(states) > 1 else states[0]
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_hub_dict(extra["model_config"]))
    load_state_dict_strict(model, state, ", ".join(str(p) for p in sources))
    max_length = extra.get("config", {}).get("data", {}).get("max_length")
    tokenizer = load_tokenizer(extra["tokenizer"], max_length=max_length, config_key="data.tokenizer")
    staged = staging_dir(export_dir)  # written whole, then put in place
    try:
        model.save_pretrained(staged, tokenizer=tokenizer)
        if average:
            record = {"weights": weights, "checkpoints": [{"path": str(path), "step": checkpoint.get("global_step")}
                                                          for path, checkpoint in zip(sources, checkpoints)]}
            (staged / AVERAGING_JSON).write_text(json.dumps(record, indent=2) + "\n")
        replace_directory(staged, export_dir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return export_dir


def weight_set(checkpoint: dict, source: str, weights: str = "raw") -> dict[str, torch.Tensor]:
    """The model's trained weights in a checkpoint, or their EMA (keys without the module's `model.`)."""
    if weights == "raw":
        return model_state_dict(checkpoint, source)
    ema = checkpoint.get(EMA_STATE_KEY)
    if ema is None:
        raise CheckpointError(f"{source} has no EMA weights: its run did not set trainer.ema.decay")
    return submodule_state(ema, "model.")


def average_state_dicts(states: Sequence[dict[str, torch.Tensor]], sources: Sequence[str]) -> dict[str, torch.Tensor]:
    """The uniform mean of weight sets (computed in float32, returned in each tensor's dtype). Integer buffers
    cannot be averaged and must be equal; keys and shapes must match."""
    first = states[0]
    for state, source in zip(states[1:], sources[1:]):
        if state.keys() != first.keys():
            key = sorted(state.keys() ^ first.keys())[0]
            raise CheckpointError(f"cannot average {sources[0]} and {source}: '{key}' is in one and not the other")
        for key, value in state.items():
            if value.shape != first[key].shape:
                raise CheckpointError(f"cannot average {sources[0]} and {source}: '{key}' has shape "
                                      f"{tuple(first[key].shape)} in one and {tuple(value.shape)} in the other")
            if not value.is_floating_point() and not torch.equal(value, first[key]):
                raise CheckpointError(f"cannot average {sources[0]} and {source}: the integer entry '{key}' differs")
    return {key: (torch.stack([s[key].float() for s in states]).mean(0).to(value.dtype)
                  if value.is_floating_point() else value)
            for key, value in first.items()}


def select_checkpoints(run: str | Path, spec: Sequence[str]) -> list[Path]:
    """The checkpoints `--average` names: "last:N" = the N step checkpoints of a run (its output_dir or its
    checkpoints folder) with the highest steps (last.ckpt repeats the newest one, so it is not counted), or
    explicit checkpoint paths. A checkpoint is a `.ckpt` file or a directory (DeepSpeed's, or fsdp2's sharded
    one); what is in it is checked when it is read (`read_lightning_checkpoint`)."""
    if len(spec) == 1 and spec[0].startswith("last:"):
        count = spec[0].removeprefix("last:")
        if not count.isdigit() or int(count) < 1:
            raise CheckpointError(f"--average {spec[0]}: expected last:N with N a positive number, e.g. last:3")
        folder = Path(run) if Path(run).is_dir() and step_checkpoints(Path(run)) else checkpoint_dir(run)
        found = step_checkpoints(folder)
        if len(found) < int(count):
            raise CheckpointError(f"--average {spec[0]}: {folder} holds {len(found)} step checkpoint(s) "
                                  f"(trainer.keep_checkpoints keeps that many; -1 keeps all)")
        return sorted(found[: int(count)])
    missing = [p for p in spec if not Path(p).exists()]
    if missing:
        raise CheckpointError(f"--average: {', '.join(missing)} does not exist")
    return [Path(p) for p in spec]


def convert_official(state_dict: str | os.PathLike, output_dir: str | os.PathLike, preset: str = "neobert",
                     tokenizer: str = "google-bert/bert-base-uncased", **fields) -> Path:
    """The official trainer's `state_dict.pt` -> the hub layout, for a model of `preset` with `fields` changed."""
    config = NeoBERTConfig.from_preset(preset, **fields)
    convert_official_state_dict(state_dict, config, output_dir,
                                tokenizer=load_tokenizer(tokenizer, max_length=config.max_length))
    return Path(output_dir)
