"""Lightning checkpoints written by this suite: writing them atomically, where a run writes them, finding the
newest one that loads (for resume), reading them (a `.ckpt` file, or a DeepSpeed checkpoint directory), and the
weights of the module's `model` inside them.

Besides Lightning's own entries, our pretraining checkpoints carry `CHECKPOINT_KEY`: the model config (hub
dict), the tokenizer name and the run config, so that a checkpoint alone can be exported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

from neobert.config import TrainerConfig
from neobert.errors import CheckpointError, ConfigError
from neobert.layout import LAST_CHECKPOINT, checkpoint_dir
from neobert.model.checkpoint import submodule_state

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "neobert"
# The EMA of the weights (trainer.ema, neobert.lit.ema): the same keys and shapes as the checkpoint's state_dict.
EMA_STATE_KEY = "ema_state_dict"
# A checkpoint being written: `.<name>.<random>.tmp` beside it (never `*.ckpt`, so never taken for a checkpoint).
PARTIAL_SUFFIX = ".tmp"
STEP_CHECKPOINT = re.compile(r"step-(\d+)(?:-v(\d+))?\.ckpt")  # ModelCheckpoint's "step-{step:08d}" (+ "-vN")
OLDER = "older"  # the reason a readable last.ckpt is passed over for a newer step checkpoint
DEEPSPEED_MODEL_STATES = Path("checkpoint") / "mp_rank_00_model_states.pt"  # tag "checkpoint", Lightning's
SHARDED_METADATA = "meta.pt"  # ModelParallelStrategy (fsdp2): the non-tensor state beside the DCP shards


# ---------------------------------------------------------------------------------------------- writing
class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO` with a local save that never leaves a partial file under the real name.

    The checkpoint is written to a temporary file in the SAME directory, flushed and fsynced, then renamed over
    the real name (`os.replace`, atomic on POSIX and Windows). Lightning's own save goes through an fsspec
    transaction that writes to the system temp directory and `shutil.move`s the file: a copy, which a kill can
    truncate, when /tmp is another filesystem. A kill at any moment leaves either the previous checkpoint or
    the new one, plus at worst a stale `.<name>.*.tmp` (removed by `remove_partial_writes`). Remote paths
    (s3://, gs://, ...) keep Lightning's save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX)
        try:
            with os.fdopen(handle, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        _fsync_directory(path.parent)  # the rename itself survives a power loss


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform/filesystem can open or fsync a directory
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def remove_partial_writes(output_dir: str | Path) -> list[Path]:
    """Deletes the temporary files of checkpoint writes that a kill interrupted (only when no run is writing
    to `output_dir`, i.e. before a resumed run starts); returns them."""
    directory = checkpoint_dir(output_dir)
    removed = []
    for partial in directory.glob(f".*.ckpt.*{PARTIAL_SUFFIX}") if directory.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
            removed.append(partial)
    return removed


# ---------------------------------------------------------------------------------------------- resume
def verify_checkpoint(path: str | Path) -> int:
    """Loads `path` (memory-mapped: the tensors are not read) and returns its global step; raises
    CheckpointError saying why it cannot be resumed from. A directory is a DeepSpeed or sharded (fsdp2)
    checkpoint: its non-tensor part is loaded and its shard index must be there."""
    path = Path(path)
    if path.is_dir():
        if (path / SHARDED_METADATA).is_file():
            required, state_key = [path / SHARDED_METADATA, path / ".metadata"], None
        else:
            required, state_key = [path / DEEPSPEED_MODEL_STATES, path / "latest"], "module"
        missing = [str(p.relative_to(path)) for p in required if not p.is_file()]
        if missing:
            raise CheckpointError(f"incomplete checkpoint directory (no {', '.join(missing)})")
        checkpoint = _load(required[0])
    else:
        checkpoint, state_key = _load(path), "state_dict"
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    missing = [key for key in (state_key, "global_step") if key is not None and key not in checkpoint]
    if missing:
        raise CheckpointError(f"not a Lightning checkpoint (no {' or '.join(missing)})")
    return int(checkpoint["global_step"])


def _load(path: Path):
    # Our own checkpoints: trusted files that also hold plain-Python loop and data state.
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # tensors are not read
        except Exception:  # torch's old format or a filesystem without mmap; else torch's own diagnosis
            return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        size = path.stat().st_size
        if size == 0:
            raise CheckpointError("empty file (0 bytes)") from err
        # The first sentence: torch appends advice about saving and weights_only.
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0].rstrip(".")
        raise CheckpointError(f"corrupt or truncated ({size} bytes): {reason}") from err


def step_checkpoints(directory: Path) -> list[Path]:
    """The `step-*.ckpt` checkpoints of a directory, newest step first (a re-written step's `-vN` first)."""
    found = [(m, p) for p in directory.glob("step-*.ckpt") if (m := STEP_CHECKPOINT.fullmatch(p.name))]
    found.sort(key=lambda mp: (int(mp[0][1]), int(mp[0][2] or 0)), reverse=True)
    return [p for _, p in found]


def newest_readable_checkpoint(output_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint a resumed run of `output_dir` starts from, and the checkpoints passed over with why.

    Candidates: `checkpoints/last.ckpt`, then the `step-*.ckpt` newest step first; each is verified by loading
    it. A step checkpoint newer than a readable last.ckpt (a kill between writing the two) is preferred to it.
    Returns (None, []) when the run has no checkpoint; raises CheckpointError naming every candidate and why
    when there are checkpoints but none is readable."""
    directory = checkpoint_dir(output_dir)
    if not directory.is_dir():
        return None, []
    last = directory / LAST_CHECKPOINT
    steps = step_checkpoints(directory)
    skipped: list[tuple[Path, str]] = []

    def readable(path: Path) -> int | None:
        try:
            return verify_checkpoint(path)
        except (CheckpointError, OSError) as err:
            skipped.append((path, str(err)))
            return None

    last_step = readable(last) if last.exists() else None
    for path in steps:
        if last_step is not None and int(STEP_CHECKPOINT.fullmatch(path.name)[1]) <= last_step:
            return last, skipped
        step = readable(path)
        if step is not None:
            if last_step is not None:
                skipped.append((last, f"{OLDER} (step {last_step}) than {path.name} (step {step}): the run "
                                      f"stopped between writing the two"))
            return path, skipped
    if last_step is not None:
        return last, skipped
    if skipped:
        raise CheckpointError(
            f"resume=true but no checkpoint in {directory} is readable: "
            + "; ".join(f"{path.name}: {reason}" for path, reason in skipped)
            + f". Move them out of {directory} to start a new run there, or choose another output_dir")
    return None, []


def set_aside(paths: list[Path]) -> dict[Path, Path]:
    """Renames unreadable checkpoints to `<name>.unreadable` (`.unreadable-2`, ... when taken): kept for
    inspection, no longer `*.ckpt`, so the resumed run writes fresh files under their names instead of
    Lightning's `-v1` copies beside them. Returns {old: new} for those renamed (a failed rename is skipped)."""
    moved = {}
    for path in paths:
        target, n = path.with_name(path.name + ".unreadable"), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.unreadable-{n}")
        with contextlib.suppress(OSError):  # gone (another rank moved it first) or a read-only directory
            os.rename(path, target)
            moved[path] = target
    return moved


# ---------------------------------------------------------------------------------------------- reading
def read_lightning_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
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
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt or truncated?): {err}") from err


def model_state_dict(checkpoint: dict, source: str) -> dict:
    """The weights of the LightningModule's `model` attribute (keys without `model.`)."""
    state = checkpoint.get("state_dict") or checkpoint.get("module")
    if state is None:
        raise CheckpointError(f"{source} has no state_dict: not a Lightning checkpoint")
    return submodule_state(state, "model.")


# ---------------------------------------------------------------------------------------------- a run's checkpoints
def step_checkpoint_callback(output_dir: str | Path, trainer: TrainerConfig) -> ModelCheckpoint:
    """`output_dir/checkpoints/step-NNNNNNNN.ckpt` every `trainer.checkpoint_every_n_steps` optimizer steps (the
    newest `trainer.keep_checkpoints` kept) and `last.ckpt`: what `resume=true` continues from."""
    return ModelCheckpoint(dirpath=checkpoint_dir(output_dir), filename="step-{step:08d}",
                           auto_insert_metric_name=False,
                           every_n_train_steps=trainer.checkpoint_every_n_steps, save_last=True,
                           save_top_k=trainer.keep_checkpoints, monitor="step", mode="max")


def refuse_existing_checkpoints(output_dir: str | Path) -> None:
    """A new run must not mix its checkpoints with an earlier run's."""
    checkpoints = checkpoint_dir(output_dir)
    if checkpoints.is_dir() and any(checkpoints.glob("*.ckpt")):
        raise ConfigError(f"output_dir={str(output_dir)!r} already holds checkpoints: set resume=true to "
                          f"continue that run, or choose another output_dir")


def resume_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint resume=true starts from: the newest one that loads (verified here, before any training).
    Unreadable newer ones (a truncated or corrupt file) are renamed `<name>.unreadable` and the fallback is
    logged in one line; leftovers of interrupted atomic writes are deleted. Raises CheckpointError when the
    run has checkpoints but none is readable; None (a new run) when it has none."""
    path, skipped = newest_readable_checkpoint(output_dir)
    for partial in remove_partial_writes(output_dir):
        log.info("removed %s, the temporary file of a checkpoint write that was interrupted", partial)
    if path is None:
        log.info("resume=true but %s has no checkpoint: starting a new run", output_dir)
        return None
    if skipped:
        moved = set_aside([p for p, reason in skipped if not reason.startswith(OLDER)])
        log.warning("resume=true: resuming from %s; skipped %s", path, "; ".join(
            f"{p.name} ({reason})" + (f", renamed to {moved[p].name}" if p in moved else "") for p, reason in skipped))
    return path
