"""Checkpoint directories, on one CPU process: fsdp2's sharded ones (torch.distributed.checkpoint shards +
`meta.pt`) and DeepSpeed's (`latest` + `checkpoint/`), laid out with the libraries' own file names. They are
verified for resume (every shard or optimizer partition there and loadable), read for export and `init_from`
into the shape of a `.ckpt` file, averaged with `--average`, and found as `step-N.ckpt` for resume.

The sharded directories here are written by torch.distributed.checkpoint itself (single process); a real
2-process fsdp2 run is in tests/test_fsdp2_multiprocess.py. DeepSpeed's are hand-made with the names and keys
that DeepSpeed 0.19's `save_checkpoint` writes (checked on CPU against its engine: `mp_rank_00_model_states.pt`
with `dp_world_size`, one `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per data-parallel rank, ZeRO-3
one `zero_pp_rank_<r>_mp_rank_00_model_states.pt` per rank), readable by DeepSpeed's own zero_to_fp32."""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from experiments.export import main as export_main
from neobert.errors import CheckpointError
from neobert.jobs.export import select_checkpoints
from neobert.jobs.pretrain import init_weights
from neobert.layout import checkpoint_dir
from neobert.lit.checkpoints import (CHECKPOINT_KEY, EMA_STATE_KEY, newest_readable_checkpoint,
                                     read_lightning_checkpoint, resume_checkpoint, step_checkpoints,
                                     verify_checkpoint)
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM


def tiny_model(seed: int) -> NeoBERTForMaskedLM:
    torch.manual_seed(seed)
    return NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", vocab_size=128, max_length=32))


def lightning_state(model: NeoBERTForMaskedLM, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The LightningModule's state_dict: its `model` attribute's keys, `model.`-prefixed."""
    return {f"model.{k}": v.detach().clone() * scale for k, v in model.state_dict().items()}


def neobert_entry(model: NeoBERTForMaskedLM) -> dict:
    return {"model_config": model.config.to_hub_dict(), "tokenizer": "google-bert/bert-base-uncased",
            "config": {"data": {"max_length": 32}}}


# ---------------------------------------------------------------------------------------------- layouts
def write_sharded(path: Path, model: NeoBERTForMaskedLM, step: int, ema: bool = False) -> dict:
    """What Lightning's ModelParallelStrategy.save_checkpoint writes: the state dict and optimizer state through
    torch.distributed.checkpoint, then the rest of the checkpoint in meta.pt."""
    state = lightning_state(model)
    optimizer = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in state.items()},
                 "param_groups": [{"lr": 1e-3, "params": list(state)}]}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp_save({"state_dict": state, "optimizer_0": optimizer}, storage_writer=FileSystemWriter(path), no_dist=True)
    meta = {"global_step": step, "epoch": 0, "loops": {}, CHECKPOINT_KEY: neobert_entry(model)}
    if ema:
        meta[EMA_STATE_KEY] = lightning_state(model, 0.5)
    torch.save(meta, path / "meta.pt")
    return state


def write_deepspeed(path: Path, model: NeoBERTForMaskedLM, step: int, world: int = 2, bf16: bool = True,
                    stage: int = 2) -> dict:
    """What Lightning's DeepSpeed strategy makes DeepSpeed write (tag "checkpoint"): the model states of rank 0
    (ZeRO-3: of every rank) with the Lightning checkpoint as client state, one optimizer partition per
    data-parallel rank holding its slice of the flat fp32 master weights, and `latest` last."""
    state = lightning_state(model)
    tag = path / "checkpoint"
    tag.mkdir(parents=True)
    shapes = OrderedDict((f"_forward_module.{k}", v.shape) for k, v in state.items())  # Lightning's wrapper
    flat = torch.cat([v.reshape(-1).float() for v in state.values()])
    align = 2 * world  # ZeRO-2 pads the flat group to a multiple of 2 x world size
    flat = torch.cat([flat, flat.new_zeros(align * math.ceil(flat.numel() / align) - flat.numel())])
    model_states = {"module": {}, "buffer_names": [], "param_shapes": [shapes], "shared_params": {},
                    "frozen_param_shapes": None, "frozen_param_fragments": None, "optimizer": None,
                    "dp_world_size": world, "mp_world_size": 1, "ds_config": {"bf16": {"enabled": bf16}},
                    "ds_version": "0.19.8", "global_steps": step, "global_step": step, "epoch": 0,
                    CHECKPOINT_KEY: neobert_entry(model)}
    prefix = "bf16_" if bf16 else ""
    for rank, part in enumerate(flat.chunk(world)):
        if stage == 3:
            torch.save(model_states, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        elif rank == 0:
            torch.save(model_states, tag / "mp_rank_00_model_states.pt")
        optimizer = {"zero_stage": stage, "partition_count": world, "single_partition_of_fp32_groups": [part.clone()]}
        torch.save({"optimizer_state_dict": optimizer, "ds_version": "0.19.8"},
                   tag / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (path / "latest").write_text("checkpoint")
    return state


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ---------------------------------------------------------------------------------------------- DeepSpeed
@pytest.mark.parametrize("bf16, stage", [(True, 2), (False, 2), (True, 3)])
def test_a_deepspeed_directory_needs_every_optimizer_partition(tmp_path, bf16, stage):
    prefix = "bf16_" if bf16 else ""
    complete = tmp_path / "complete"
    write_deepspeed(complete, tiny_model(0), step=6, world=2, bf16=bf16, stage=stage)
    assert verify_checkpoint(complete) == 6

    missing = tmp_path / "missing"
    write_deepspeed(missing, tiny_model(0), step=6, world=2, bf16=bf16, stage=stage)
    (missing / "checkpoint" / f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=rf"incomplete checkpoint directory \(no checkpoint/{prefix}zero_pp_rank_1_"
                                              rf"mp_rank_00_optim_states.pt: data-parallel rank 1 of the 2 that saved it"):
        verify_checkpoint(missing)

    truncated = tmp_path / "truncated"
    write_deepspeed(truncated, tiny_model(0), step=6, world=2, bf16=bf16, stage=stage)
    truncate(truncated / "checkpoint" / f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=rf"^checkpoint/{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt: "
                                              r"corrupt or truncated \(\d+ bytes\)"):
        verify_checkpoint(truncated)

    if stage == 3:  # ZeRO-3: every rank's model states too
        (complete / "checkpoint" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
        with pytest.raises(CheckpointError, match=r"no checkpoint/zero_pp_rank_1_mp_rank_00_model_states.pt"):
            verify_checkpoint(complete)


def test_a_deepspeed_directory_without_latest_or_model_states_is_incomplete(tmp_path):
    write_deepspeed(tmp_path / "a", tiny_model(0), step=2)
    (tmp_path / "a" / "latest").unlink()  # killed before DeepSpeed's last write (or while rewriting in place)
    with pytest.raises(CheckpointError, match=r"^incomplete checkpoint directory \(no latest\)$"):
        verify_checkpoint(tmp_path / "a")
    write_deepspeed(tmp_path / "b", tiny_model(0), step=2)
    (tmp_path / "b" / "checkpoint" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint/mp_rank_00_model_states.pt\)"):
        verify_checkpoint(tmp_path / "b")
    (tmp_path / "c").mkdir()
    with pytest.raises(CheckpointError, match="a directory but not a checkpoint"):
        verify_checkpoint(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"c is not a readable checkpoint: a directory but not a checkpoint"):
        read_lightning_checkpoint(tmp_path / "c")


def test_resume_passes_over_a_deepspeed_directory_with_a_bad_partition(tmp_path):
    """As for files: the newest readable checkpoint is resumed from; the unreadable ones are set aside."""
    directory = checkpoint_dir(tmp_path / "run")
    write_deepspeed(directory / "step-00000004.ckpt", tiny_model(0), step=4)
    write_deepspeed(directory / "step-00000006.ckpt", tiny_model(0), step=6)
    write_deepspeed(directory / "last.ckpt", tiny_model(0), step=6)
    truncate(directory / "last.ckpt" / "checkpoint" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (directory / "step-00000006.ckpt" / "checkpoint" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    path, skipped = newest_readable_checkpoint(tmp_path / "run")
    assert path == directory / "step-00000004.ckpt"
    assert [(p.name, reason.split(":")[0]) for p, reason in skipped] == [
        ("last.ckpt", "checkpoint/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("step-00000006.ckpt", "incomplete checkpoint directory (no checkpoint/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")]
    assert resume_checkpoint(tmp_path / "run") == directory / "step-00000004.ckpt"
    assert sorted(p.name for p in directory.iterdir()) == [
        "last.ckpt.unreadable", "step-00000004.ckpt", "step-00000006.ckpt.unreadable"]


def test_deepspeed_directories_are_read_and_averaged_by_the_export_cli(tmp_path):
    pytest.importorskip("deepspeed")  # DeepSpeed's zero_to_fp32 gathers the partitions (no engine, no GPU)
    a, b = tiny_model(0), tiny_model(1)
    states = [write_deepspeed(tmp_path / "a", a, step=2), write_deepspeed(tmp_path / "b", b, step=4)]
    checkpoint = read_lightning_checkpoint(tmp_path / "b")
    assert checkpoint["global_step"] == 4 and checkpoint[CHECKPOINT_KEY] == neobert_entry(b)
    assert checkpoint["state_dict"].keys() == states[1].keys()
    for key, value in states[1].items():
        torch.testing.assert_close(checkpoint["state_dict"][key], value, rtol=0, atol=0)

    assert select_checkpoints(tmp_path, [str(tmp_path / "a"), str(tmp_path / "b")]) == [tmp_path / "a", tmp_path / "b"]
    out = export_main([str(tmp_path / "a"), str(tmp_path / "avg"), "--average", str(tmp_path / "a"),
                       str(tmp_path / "b")])
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == {k.removeprefix("model.") for k in states[0]}
    for key, value in exported.items():
        torch.testing.assert_close(value, (states[0]["model." + key] + states[1]["model." + key]) / 2)


def test_reading_a_deepspeed_directory_without_deepspeed_says_so(tmp_path, monkeypatch):
    import lightning.pytorch.utilities.deepspeed as lightning_deepspeed

    write_deepspeed(tmp_path / "last.ckpt", tiny_model(0), step=2)
    monkeypatch.setattr(lightning_deepspeed, "_DEEPSPEED_AVAILABLE", False)  # as where it is not installed
    with pytest.raises(CheckpointError, match=r"last.ckpt is a DeepSpeed checkpoint directory: reading it needs "
                                              r"deepspeed \(pip install deepspeed\)"):
        read_lightning_checkpoint(tmp_path / "last.ckpt")


# ---------------------------------------------------------------------------------------------- fsdp2
def test_a_sharded_directory_reads_like_a_ckpt_file_without_a_process_group(tmp_path):
    model = tiny_model(0)
    state = write_sharded(tmp_path / "last.ckpt", model, step=8, ema=True)
    assert not torch.distributed.is_initialized()
    checkpoint = read_lightning_checkpoint(tmp_path / "last.ckpt")
    assert checkpoint["global_step"] == 8 and checkpoint[CHECKPOINT_KEY] == neobert_entry(model)
    assert "optimizer_0" not in checkpoint  # the optimizer state is not read
    assert checkpoint["state_dict"].keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(checkpoint["state_dict"][key], value)
    for key, value in lightning_state(model, 0.5).items():
        assert torch.equal(checkpoint[EMA_STATE_KEY][key], value)

    # The export CLI, raw and EMA weights, and init_from.
    exported = load_file(export_main([str(tmp_path / "last.ckpt"), str(tmp_path / "out")]) / "model.safetensors")
    ema = load_file(export_main([str(tmp_path / "last.ckpt"), str(tmp_path / "ema"), "--weights", "ema"])
                    / "model.safetensors")
    assert exported.keys() == ema.keys() == {k.removeprefix("model.") for k in state}
    for key in exported:
        assert torch.equal(exported[key], state["model." + key])
        assert torch.equal(ema[key], state["model." + key] * 0.5)
    fresh = tiny_model(7)
    init_weights(fresh, tmp_path / "last.ckpt")
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state["model." + key])


def test_a_sharded_directory_needs_every_shard_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    write_sharded(path, tiny_model(0), step=8)
    assert verify_checkpoint(path) == 8
    shard = path / "__0_0.distcp"
    whole = shard.read_bytes()
    truncate(shard)  # e.g. killed while rewriting last.ckpt in place
    with pytest.raises(CheckpointError, match=r"^__0_0.distcp: truncated \(\d+ bytes, .metadata says \d+\)$"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"last.ckpt is not a readable checkpoint: __0_0.distcp: truncated"):
        read_lightning_checkpoint(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint directory \(no __0_0.distcp, a shard .metadata lists\)"):
        verify_checkpoint(path)
    shard.write_bytes(whole)
    (path / "meta.pt").unlink()  # rank 0 writes meta.pt last
    with pytest.raises(CheckpointError, match=r"^incomplete checkpoint directory \(no meta.pt\)$"):
        verify_checkpoint(path)


def test_step_checkpoint_directories_are_found_resumed_and_averaged(tmp_path):
    """ModelCheckpoint names a directory checkpoint like a file: step-N.ckpt, last.ckpt."""
    directory = checkpoint_dir(tmp_path / "run")
    models = {step: tiny_model(step) for step in (2, 4, 6)}
    states = {step: write_sharded(directory / f"step-{step:08d}.ckpt", model, step) for step, model in models.items()}
    assert [p.name for p in step_checkpoints(directory)] == [
        "step-00000006.ckpt", "step-00000004.ckpt", "step-00000002.ckpt"]
    write_sharded(directory / "last.ckpt", models[4], 4)  # killed between step-6 and last.ckpt
    path, skipped = newest_readable_checkpoint(tmp_path / "run")
    assert path == directory / "step-00000006.ckpt"
    assert [p.name for p, _ in skipped] == ["last.ckpt"]

    chosen = select_checkpoints(tmp_path / "run", ["last:2"])
    assert chosen == [directory / "step-00000004.ckpt", directory / "step-00000006.ckpt"]
    assert select_checkpoints(tmp_path / "run", [str(p) for p in chosen]) == chosen  # explicit directory paths
    out = export_main([str(tmp_path / "run"), str(tmp_path / "avg"), "--average", *map(str, chosen)])
    exported = load_file(out / "model.safetensors")
    for key, value in exported.items():
        torch.testing.assert_close(value, (states[4]["model." + key] + states[6]["model." + key]) / 2)
    with pytest.raises(CheckpointError, match="does not exist"):
        select_checkpoints(tmp_path / "run", [str(directory / "step-00000008.ckpt")])
