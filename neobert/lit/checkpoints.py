"""Lightning checkpoints written by this suite: writing them atomically, where a run writes them, finding the
newest one that loads (for resume), reading them (a `.ckpt` file, or a DeepSpeed or fsdp2 checkpoint directory), and the
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
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as _load_distributed_checkpoint
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

from neobert.config import TrainerConfig
from neobert.errors import CheckpointError, ConfigError
from neobert.layout import LAST_CHECKPOINT, checkpoint_dir
from neobert.model.checkpoint import submodule_state
from neobert.outputs import check_free_space, filled_the_disk, hold_output_dir, out_of_space

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "neobert"
# The optimizer.name of a checkpoint of a job other than pretraining (whose CHECKPOINT_KEY holds the run config).
OPTIMIZER_NAME_KEY = "neobert_optimizer"
# The EMA of the weights (trainer.ema, neobert.lit.ema): the same keys and shapes as the checkpoint's state_dict.
EMA_STATE_KEY = "ema_state_dict"
CHECKPOINTS_KEPT = ("nothing was lost: the checkpoints already there are intact and no partial one is left (a "
                    "pretraining or contrastive run continues from the newest with resume=true)")
# A checkpoint being written: `.<name>.<random>.tmp` beside it (never `*.ckpt`, so never taken for a checkpoint).
PARTIAL_SUFFIX = ".tmp"
STEP_CHECKPOINT = re.compile(r"step-(\d+)(?:-v(\d+))?\.ckpt")  # ModelCheckpoint's "step-{step:08d}" (+ "-vN")
OLDER = "older"  # the reason a readable last.ckpt is passed over for a newer step checkpoint
DEEPSPEED_MODEL_STATES = Path("checkpoint") / "mp_rank_00_model_states.pt"  # tag "checkpoint", Lightning's
DEEPSPEED_LATEST = "latest"  # the tag of the directory's checkpoint, written after every rank's files
SHARDED_METADATA = "meta.pt"  # ModelParallelStrategy (fsdp2): the non-tensor state beside the DCP shards
SHARDED_INDEX = ".metadata"  # torch.distributed.checkpoint's index of the shards: what is where


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
        check_free_space(path.parent, _checkpoint_size(path.parent), "a checkpoint", CHECKPOINTS_KEPT)
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX)
        try:
            with os.fdopen(handle, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        except BaseException as err:
            full, written = filled_the_disk(err, path.parent), _size(partial)
            with contextlib.suppress(OSError):
                os.unlink(partial)
            if full:
                raise out_of_space(path.parent, "a checkpoint", written, CHECKPOINTS_KEPT, known=False) from err
            raise
        _fsync_directory(path.parent)  # the rename itself survives a power loss


def _checkpoint_size(directory: Path) -> int:
    """What the next checkpoint in `directory` takes: about as much as the largest one there (0: none yet)."""
    return max((_size(p) for p in directory.glob("*.ckpt") if p.is_file()), default=0)


def _size(path: str | Path) -> int:
    with contextlib.suppress(OSError):
        return os.path.getsize(path)
    return 0


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform/filesystem can open or fsync a directory
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def remove_partial_writes(output_dir: str | Path) -> list[Path]:
    """Deletes the temporary files of checkpoint writes that a kill interrupted (only by the process holding
    `output_dir`, before it writes any: `resume_checkpoint`); returns them."""
    directory = checkpoint_dir(output_dir)
    removed = []
    for partial in directory.glob(f".*.ckpt.*{PARTIAL_SUFFIX}") if directory.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
            removed.append(partial)
    return removed


# ---------------------------------------------------------------------------------------------- resume
def verify_checkpoint(path: str | Path) -> int:
    """The global step of the checkpoint at `path` (file, or fsdp2/DeepSpeed directory) that `verified_checkpoint`
    found whole; CheckpointError saying why it cannot be resumed from."""
    return int(verified_checkpoint(path)["global_step"])


def verified_checkpoint(path: str | Path) -> dict:
    """`verify_checkpoint`'s checks, returning the checkpoint's entries as loaded (memory-mapped tensors; of a
    directory, its non-tensor part: fsdp2's meta.pt, DeepSpeed's model states), CHECKPOINT_KEY among them."""
    path = Path(path)
    if path.is_dir():
        if _is_sharded(path):
            checkpoint, state_key = _verify_sharded(path), None
        else:
            checkpoint, state_key = _verify_deepspeed(path), "module"
    else:
        checkpoint, state_key = _load(path), "state_dict"
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    missing = [key for key in (state_key, "global_step") if key is not None and key not in checkpoint]
    if missing:
        raise CheckpointError(f"not a Lightning checkpoint (no {' or '.join(missing)})")
    return checkpoint


def _is_sharded(path: Path) -> bool:
    # rank 0 writes meta.pt after the shards and their index (.metadata): a directory with either is fsdp2's
    return (path / SHARDED_METADATA).is_file() or (path / SHARDED_INDEX).is_file()


def _verify_sharded(path: Path) -> dict:
    """fsdp2 (ModelParallelStrategy): `meta.pt` (rank 0's non-tensor state) and torch.distributed.checkpoint's
    `.metadata` (written last, after every rank's shards) must load, and every shard file it indexes must be
    there, at least as long as the index says (a kill while rewriting a shard in place leaves it shorter)."""
    missing = [name for name in (SHARDED_METADATA, SHARDED_INDEX) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"incomplete checkpoint directory (no {', '.join(missing)})")
    checkpoint = _load_member(path, SHARDED_METADATA)
    try:
        index = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(f"{SHARDED_INDEX}: corrupt or truncated ({_first_sentence(err)})") from err
    needed: dict[str, int] = {}
    for item in index.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"incomplete checkpoint directory (no {name}, a shard {SHARDED_INDEX} lists)")
        if shard.stat().st_size < size:
            raise CheckpointError(f"{name}: truncated ({shard.stat().st_size} bytes, {SHARDED_INDEX} says {size})")
    return checkpoint


def _verify_deepspeed(path: Path) -> dict:
    """DeepSpeed writes, under the tag that `latest` names ("checkpoint" for Lightning), the model states of
    data-parallel rank 0 (ZeRO-3: of every rank) and under ZeRO one optimizer partition per data-parallel rank
    (its share of the fp32 master weights and optimizer moments), and `latest` only after every rank's files.
    All of them must load; the data-parallel world size is the model states' `dp_world_size`."""
    latest = path / DEEPSPEED_LATEST
    tag = latest.read_text().strip() if latest.is_file() else DEEPSPEED_MODEL_STATES.parent.name
    if not latest.is_file() and not (path / tag).is_dir():
        raise CheckpointError(f"a directory but not a checkpoint (neither DeepSpeed's {DEEPSPEED_LATEST} and "
                              f"{tag}/ nor fsdp2's {SHARDED_METADATA} and {SHARDED_INDEX})")
    stage3 = not (path / tag / DEEPSPEED_MODEL_STATES.name).is_file() and (path / tag / _zero3_states(0)).is_file()
    model_states = f"{tag}/{_zero3_states(0) if stage3 else DEEPSPEED_MODEL_STATES.name}"
    missing = [name for name in (model_states, DEEPSPEED_LATEST) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"incomplete checkpoint directory (no {', '.join(missing)})")
    checkpoint = _load_member(path, model_states)
    if not isinstance(checkpoint, dict) or checkpoint.get("param_shapes") is None:
        return checkpoint  # not ZeRO (the optimizer state is in the model states) or not DeepSpeed's: see below
    world = checkpoint.get("dp_world_size")
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{model_states}: no dp_world_size (the data-parallel world size of the save)")
    bf16 = ((checkpoint.get("ds_config") or {}).get("bf16") or {}).get("enabled")
    prefix = "bf16_" if bf16 or any((path / tag).glob("bf16_zero_pp_rank_*_optim_states.pt")) else ""
    for rank in range(world):
        partitions = [f"{tag}/{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
        partitions += [f"{tag}/{_zero3_states(rank)}"] if stage3 and rank else []
        for name in partitions:
            if not (path / name).is_file():
                raise CheckpointError(f"incomplete checkpoint directory (no {name}: data-parallel rank {rank} of "
                                      f"the {world} that saved it)")
            _load_member(path, name)
    return checkpoint


def _zero3_states(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _load_member(directory: Path, name: str):
    """`_load` of a file of a checkpoint directory; its errors name the file."""
    try:
        return _load(directory / name)
    except CheckpointError as err:
        raise CheckpointError(f"{name}: {err}") from err


def _first_sentence(err: BaseException) -> str:
    # torch appends advice about saving and weights_only after the first sentence
    return (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0].rstrip(".")


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
        raise CheckpointError(f"corrupt or truncated ({size} bytes): {_first_sentence(err)}") from err


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
    """A checkpoint as one dict of a `.ckpt` file's shape, read in this process alone (no process group): at least
    `state_dict` (the LightningModule's keys, `model.`-prefixed) and `global_step`, and our CHECKPOINT_KEY and
    EMA_STATE_KEY where the run saved them. `path`: a `.ckpt` file; a sharded fsdp2 directory (`meta.pt` plus the
    weights gathered from the shards; the optimizer state is not read); a DeepSpeed directory (the ZeRO partitions
    gathered into fp32 weights). A directory is verified first (`verify_checkpoint`: every shard or partition)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            raise CheckpointError(f"{path} is not a readable checkpoint: {err}") from err
        return _read_sharded(path) if _is_sharded(path) else _read_deepspeed(path)
    try:
        # Our own checkpoints: trusted files that also hold plain-Python loop and data state.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt or truncated?): {err}") from err


def _read_sharded(path: Path) -> dict:
    # torch.distributed.checkpoint's offline reading, as its public dcp_to_torch_save does it (torch 2.13): the
    # tensors rebuilt whole from the index, only those under "state_dict" (not "optimizer_0"), no process group.
    checkpoint = _load_member(path, SHARDED_METADATA)
    state: dict = {}
    try:
        _load_distributed_checkpoint(state, storage_reader=FileSystemReader(path),
                                     planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}), no_dist=True)
    except Exception as err:
        raise CheckpointError(f"{path} is not a readable checkpoint: its shards cannot be read "
                              f"({_first_sentence(err)})") from err
    if "state_dict" not in state:
        raise CheckpointError(f"{path} has no state_dict in its shards: not a Lightning checkpoint")
    return {**checkpoint, "state_dict": state["state_dict"]}


def _read_deepspeed(path: Path) -> dict:
    try:
        # Imported here: it imports deepspeed, an optional GPU dependency.
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        with tempfile.TemporaryDirectory() as tmp:
            return convert_zero_checkpoint_to_fp32_state_dict(str(path), f"{tmp}/model.ckpt")
    except ModuleNotFoundError as err:
        raise CheckpointError(f"{path} is a DeepSpeed checkpoint directory: reading it needs deepspeed "
                              f"(pip install deepspeed)") from err
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"{path} is not a readable DeepSpeed checkpoint: {_first_sentence(err)}") from err


def model_state_dict(checkpoint: dict, source: str) -> dict:
    """The weights of the LightningModule's `model` attribute (keys without `model.`)."""
    state = checkpoint.get("state_dict") or checkpoint.get("module")
    if state is None:
        raise CheckpointError(f"{source} has no state_dict: not a Lightning checkpoint")
    return submodule_state(state, "model.")


# ---------------------------------------------------------------------------------------------- a run's checkpoints
class StepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint, keeping a step's validation with its checkpoint. Lightning writes the checkpoint of a step
    that validates before the validation, and a run resumed from it skips that validation as done (Lightning 2.6):
    a validation interrupted by Ctrl-C or a kill was never run. Here last.ckpt is written again once the validation
    has run, and a run resumed from a checkpoint written before its validation runs that validation first."""

    def on_train_start(self, trainer, pl_module) -> None:
        loop = trainer.fit_loop.epoch_loop
        batches = loop.total_batch_idx + 1  # the micro-batches the checkpoint had trained
        if trainer.enable_validation and loop.restarted_on_train_batch_end and batches % trainer.val_check_batch == 0:
            self._last_global_step_saved = trainer.global_step  # its checkpoint: written again after it
            loop.val_loop.restarting = False  # a whole validation, not the rest of one
            trainer.validating = True
            loop.val_loop.run()  # logged at the step an uninterrupted run logs it
            trainer.training = True

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        if self.last_model_path and self._last_global_step_saved == trainer.global_step:
            trainer.save_checkpoint(self.last_model_path)


def step_checkpoint_callback(output_dir: str | Path, trainer: TrainerConfig) -> ModelCheckpoint:
    """`output_dir/checkpoints/step-NNNNNNNN.ckpt` every `trainer.checkpoint_every_n_steps` optimizer steps (the
    newest `trainer.keep_checkpoints` kept) and `last.ckpt`: what `resume=true` continues from."""
    return StepCheckpoint(dirpath=checkpoint_dir(output_dir), filename="step-{step:08d}",
                          auto_insert_metric_name=False,
                          every_n_train_steps=trainer.checkpoint_every_n_steps, save_last=True,
                          save_top_k=trainer.keep_checkpoints, monitor="step", mode="max")


def refuse_existing_checkpoints(output_dir: str | Path) -> None:
    """A new run must not mix its checkpoints with an earlier run's."""
    checkpoints = checkpoint_dir(output_dir)
    if checkpoints.is_dir() and any(checkpoints.glob("*.ckpt")):
        raise ConfigError(f"output_dir={str(output_dir)!r} already holds checkpoints: set resume=true to "
                          f"continue that run, or choose another output_dir")


def saved_optimizer_name(checkpoint: dict) -> str | None:
    """The optimizer.name a checkpoint was trained with: its run config's (pretraining, under CHECKPOINT_KEY), or
    OPTIMIZER_NAME_KEY's (the other jobs); None when it does not say (written before either existed)."""
    config = (checkpoint.get(CHECKPOINT_KEY) or {}).get("config") or {}
    return (config.get("optimizer") or {}).get("name") or checkpoint.get(OPTIMIZER_NAME_KEY)


def refuse_another_optimizer(checkpoint: str | Path, name: str, start_over: str) -> None:
    """A checkpoint to continue (resume, a phase, branch_from) must have been trained with this run's optimizer:
    another one cannot load its state (AdamW's into Muon: `KeyError: 'muon'`; into StableAdamW: `KeyError:
    'triton'`). A ConfigError naming optimizer.name, before the Trainer makes any log directory; `start_over`:
    how else to use the checkpoint ("choose another output_dir ...")."""
    saved = saved_optimizer_name(verified_checkpoint(checkpoint))
    if saved is not None and saved != name:
        raise ConfigError(f"invalid config key 'optimizer.name': {checkpoint} was trained with optimizer.name="
                          f"{saved!r}, this run asks for {name!r} (an optimizer cannot continue another one's "
                          f"state): resume it with optimizer.name={saved}, or {start_over}")


def resume_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint resume=true starts from: the newest one that loads (verified here, before any training).
    Unreadable newer ones (a truncated or corrupt file) are renamed `<name>.unreadable` and the fallback is
    logged in one line; leftovers of interrupted atomic writes are deleted. Only the process holding output_dir
    renames or deletes (neobert.outputs.hold_output_dir, taken here if the job has not): never a live run's files,
    and once per run, not on each of its ranks. Raises CheckpointError when the run has checkpoints but none is
    readable; None (a new run) when it has none."""
    with hold_output_dir(output_dir) as writer:
        path, skipped = newest_readable_checkpoint(output_dir)
        for partial in remove_partial_writes(output_dir) if writer else ():
            log.info("removed %s, the temporary file of a checkpoint write that was interrupted", partial)
        if path is None:
            log.info("resume=true but %s has no checkpoint: starting a new run", output_dir)
            return None
        if skipped:
            moved = set_aside([p for p, reason in skipped if not reason.startswith(OLDER)]) if writer else {}
            log.warning("resume=true: resuming from %s; skipped %s", path, "; ".join(
                f"{p.name} ({reason})" + (f", renamed to {moved[p].name}" if p in moved else "")
                for p, reason in skipped))
    return path
