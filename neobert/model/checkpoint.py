"""Reading and writing the official hub layout (`config.json` + `model.safetensors`), strictly.

Every mismatch between a checkpoint and the model is an error that names the tensors, with two deliberate
exceptions: heads the target model does not have are dropped (an MLM checkpoint loads into the bare encoder),
and a classification head absent from the checkpoint is freshly initialised (the usual start of fine-tuning).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from neobert.errors import CheckpointError
from neobert.layout import CONFIG_NAME, WEIGHTS_NAME
from neobert.model.config import NeoBERTConfig
from neobert.outputs import check_free_space, filled_the_disk, out_of_space

log = logging.getLogger(__name__)

HEAD_PREFIXES = ("decoder.", "dense.", "classifier.")
# Room counted for the tokenizer's files beside the weights (bert-base-uncased's take 0.7 MB).
TOKENIZER_ALLOWANCE = 4 << 20
NO_PARTIAL_EXPORT = "no partial export is left, and the checkpoints or model it comes from are untouched"


def save_pretrained(model, directory: str | os.PathLike, tokenizer=None) -> None:
    """`model` is one of our modules; its class names its hub architecture (`hub_architecture`). A disk without
    room for it is refused before writing; a write that fails leaves none of its files (nor an empty directory)."""
    directory = Path(directory)
    config = {"architectures": [type(model).hub_architecture], **model.config.to_hub_dict()}
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    size = sum(t.nbytes for t in state.values()) + TOKENIZER_ALLOWANCE
    check_free_space(directory, size, "an export", NO_PARTIAL_EXPORT)
    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.iterdir())
    try:
        _write_export(directory, state, config, tokenizer)
    except BaseException as err:
        full = filled_the_disk(err, directory)
        _remove_new_entries(directory, before)
        if full:
            raise out_of_space(directory, "an export", size, NO_PARTIAL_EXPORT) from err
        raise


def _remove_new_entries(directory: Path, before: set[Path]) -> None:
    """What a failed export wrote into `directory`, and the directory itself when that leaves it empty."""
    for path in set(directory.iterdir()) - before:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    if not any(directory.iterdir()):
        directory.rmdir()


def _write_export(directory: Path, state: dict[str, torch.Tensor], config: dict, tokenizer) -> None:
    # Write to temporary names first so a crash never leaves a half-written checkpoint under the real name.
    tmp_weights, tmp_config = directory / (WEIGHTS_NAME + ".tmp"), directory / (CONFIG_NAME + ".tmp")
    save_file(state, str(tmp_weights), metadata={"format": "pt"})
    tmp_config.write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    os.replace(tmp_weights, directory / WEIGHTS_NAME)
    os.replace(tmp_config, directory / CONFIG_NAME)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def read_config(directory: str | os.PathLike, **overrides) -> NeoBERTConfig:
    path = Path(directory) / CONFIG_NAME
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a NeoBERT checkpoint directory needs config.json")
    try:
        hub = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    config = NeoBERTConfig.from_hub_dict(hub)
    return dataclasses.replace(config, **overrides) if overrides else config


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file (corrupt or truncated?): {err}") from err


def load_pretrained(cls, directory: str | os.PathLike, **config_overrides):
    """Builds `cls` from a hub-layout directory and loads its weights strictly."""
    config = read_config(directory, **config_overrides)
    model = cls(config)
    load_state_dict_strict(model, read_weights(Path(directory) / WEIGHTS_NAME), source=str(directory))
    return model


def load_state_dict_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint",
                           keep_fresh: tuple[str, ...] = ()):
    """Loads `state` into `model`; any missing, unexpected or mis-shaped tensor is an error naming it. Tensors
    under the `keep_fresh` prefixes are left as the model initialised them, on both sides (e.g. a classifier
    layer whose label set differs)."""
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith(keep_fresh)}
    state = {k: v for k, v in _match_prefix(state, expected).items() if not k.startswith(keep_fresh)}
    target_heads = {p for p in HEAD_PREFIXES if any(k.startswith(p) for k in expected)}
    state = {k: v for k, v in state.items() if not (k.startswith(HEAD_PREFIXES) and not k.startswith(tuple(target_heads)))}

    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    fresh_head = [k for k in missing if k.startswith(("dense.", "classifier."))]
    head_in_checkpoint = any(k.startswith(("dense.", "classifier.")) for k in state)
    if fresh_head and not head_in_checkpoint:
        missing = [k for k in missing if k not in fresh_head]
        log.info("%s has no classification head: %s initialised fresh", source, ", ".join(fresh_head))
    mis_shaped = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(state) & set(expected))
        if state[k].shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    if mis_shaped:
        problems.append(f"mis-shaped tensors: {mis_shaped}")
    if problems:
        raise CheckpointError(f"{source} does not match {type(model).__name__}: " + "; ".join(problems))
    model.load_state_dict(state, strict=False)
    return model


def _match_prefix(state: dict[str, torch.Tensor], expected) -> dict[str, torch.Tensor]:
    """The bare encoder has no `model.` prefix, the heads have it (as on the hub)."""
    model_expects_prefix = any(k.startswith("model.") for k in expected)
    checkpoint_has_prefix = any(k.startswith("model.") for k in state)
    if checkpoint_has_prefix and not model_expects_prefix:
        return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    if model_expects_prefix and not checkpoint_has_prefix:
        return {(k if k.startswith(HEAD_PREFIXES) else "model." + k): v for k, v in state.items()}
    return state


def submodule_state(state: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The weights of one attribute of a LightningModule (e.g. its `model.`), with that prefix removed."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
