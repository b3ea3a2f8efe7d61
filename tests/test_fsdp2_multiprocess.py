"""fsdp2 (trainer.strategy=fsdp2: Lightning's ModelParallelStrategy, `fully_shard` in configure_model) with two
CPU processes: validation with an odd number of batches (every forward all-gathers the shards, so every rank must
run as many), then its sharded checkpoint directories exported, averaged and used as `init_from` on one process.
And the arithmetic of dealing validation batches to ranks."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from experiments.export import main as export_main
from neobert.data import pretraining
from neobert.data.pretraining import PretrainingDataModule
from neobert.errors import DataError
from neobert.eval.plots import read_curves
from neobert.jobs.export import select_checkpoints
from neobert.jobs.pretrain import prepare, run_pretraining
from neobert.lit.checkpoints import newest_readable_checkpoint, verify_checkpoint
from neobert.lit.pretrain import MLMPretrainingModule

from test_pretrain import tiny_config
from test_pretrain_slow import cli, write_yaml

# The run takes about a minute on 2 idle cores; a rank left waiting in a collective would wait forever.
RUN_TIMEOUT_S = 300


# ---------------------------------------------------------------------------------------------- dealing
def deal(monkeypatch, batches: int, world_size: int, cap: int = 0) -> list[list[int]]:
    """Each rank's validation batches (batch i is i), as `PretrainingDataModule.setup` deals them."""
    monkeypatch.setattr(pretraining, "validation_batches", lambda *args: list(range(batches)))
    shares = []
    for rank in range(world_size):
        datamodule = PretrainingDataModule(SimpleNamespace(validation_docs=100, validation_batches=cap, sources=[]), None,
                                            None, 4)
        datamodule.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
        datamodule.setup("fit")
        shares.append(datamodule.validation_batches)
    return shares


@pytest.mark.parametrize("batches, world_size, cap, per_rank, dropped", [
    (63, 8, 0, 7, 7),  # was 8 batches on ranks 0-6 and 7 on rank 7: rank 7 left the others waiting
    (3, 2, 0, 1, 1),
    (64, 8, 0, 8, 0),
    (63, 8, 5, 5, None),  # the cap (data.validation_batches) is per rank, as before; it drops more than the rest
    (63, 8, 7, 7, 7),
    (10, 1, 4, 4, None),  # one process: the first `cap` batches, as before
    (10, 1, 0, 10, 0),
])
def test_every_rank_validates_the_same_number_of_batches(monkeypatch, caplog, batches, world_size, cap, per_rank,
                                                         dropped):
    with caplog.at_level(logging.INFO, logger="neobert.data.pretraining"):
        shares = deal(monkeypatch, batches, world_size, cap)
    assert [len(share) for share in shares] == [per_rank] * world_size
    dealt = sorted(batch for share in shares for batch in share)
    assert dealt == list(range(per_rank * world_size))  # the first ones, each to one rank
    assert shares[0][:2] == [0, world_size][:per_rank]  # round robin, as before
    logged = [r.getMessage() for r in caplog.records if r.name == "neobert.data.pretraining"]
    if dropped:  # said once (by rank 0), not once per rank
        assert logged == [f"validation: the last {dropped} of {batches} batches are dropped so that each of the "
                          f"{world_size} ranks validates {batches // world_size} (ranks validate in step)"]
    else:
        assert logged == []


def test_fewer_validation_batches_than_ranks_is_a_data_error(monkeypatch):
    with pytest.raises(DataError, match=r"data.validation_docs=100 gives 1 validation batch\(es\), fewer than the "
                                        r"2 ranks \(every rank needs one\)"):
        deal(monkeypatch, 1, 2)


# ---------------------------------------------------------------------------------------------- 2 processes
def model_weights(state_dict: dict) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in state_dict.items()}


def whole_checkpoint(path, tmp_path) -> dict:
    """torch's own offline converter of a torch.distributed.checkpoint directory: the reference."""
    target = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(path, target)
    return torch.load(target, weights_only=False)


@pytest.mark.slow
def test_fsdp2_on_two_processes_validates_an_odd_number_of_batches_and_its_checkpoints_export(tmp_path):
    config = write_yaml(tmp_path, "trainer.strategy=fsdp2", "trainer.devices=2", "trainer.max_steps=4",
                        "trainer.keep_checkpoints=-1", "data.validation_docs=12", "trainer.eval_every_n_steps=2")
    proc = cli("--config", str(config), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 0 and the rank-1 process Lightning started
        out, _ = proc.communicate()
        pytest.fail(f"the 2-process fsdp2 run did not finish in {RUN_TIMEOUT_S} s (a rank waiting for the other in "
                    f"a collective?); its output:\n{out[-5000:]}")
    assert proc.returncode == 0, out[-5000:]
    # 12 held-out documents = 3 batches of 4: one each, the third dropped; validated at steps 2 and 4.
    assert ("validation: the last 1 of 3 batches are dropped so that each of the 2 ranks validates 1 (ranks "
            "validate in step)") in out
    run = tmp_path / "run"
    curves = read_curves(sorted((run / "logs").glob("version_*/metrics.csv")), ["val/loss"])
    assert len(curves["val/loss"]) == 2

    # The checkpoints are fsdp2's sharded directories: one shard per rank, meta.pt beside them.
    checkpoints = run / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert verify_checkpoint(last) == 4
    assert newest_readable_checkpoint(run) == (last, [])

    # Exported on this (single, process-group-less) process with the export CLI: the checkpoint's weights, which
    # are also those the run exported itself at its end (gathered from the live sharded model).
    assert not torch.distributed.is_initialized()
    reference = model_weights(whole_checkpoint(last, tmp_path)["state_dict"])
    exported = load_file(export_main([str(last), str(tmp_path / "export")]) / "model.safetensors")
    own = load_file(run / "export" / "model.safetensors")
    assert exported.keys() == reference.keys() == own.keys()
    for key, value in exported.items():
        assert torch.equal(value, reference[key]) and torch.equal(value, own[key])

    # --average over step directories (last:2, or their paths).
    chosen = select_checkpoints(run, ["last:2"])
    assert chosen == [checkpoints / "step-00000002.ckpt", checkpoints / "step-00000004.ckpt"]
    averaged = load_file(export_main([str(run), str(tmp_path / "avg"), "--average", *map(str, chosen)])
                         / "model.safetensors")
    step2 = model_weights(whole_checkpoint(chosen[0], tmp_path)["state_dict"])
    for key, value in averaged.items():
        torch.testing.assert_close(value, (step2[key] + reference[key]) / 2)

    # init_from the sharded directory in a 1-process run: it starts from exactly these weights.
    started = {}

    class Capture(L.Callback):
        def on_train_start(self, trainer, pl_module):
            started.update({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()})

    stage2 = tiny_config(tmp_path / "stage2", f"init_from={last}", "trainer.max_steps=1")
    run_pretraining(stage2, extra_callbacks=[Capture()])
    assert started.keys() == exported.keys()
    for key, value in started.items():
        assert torch.equal(value, exported[key])


# ---------------------------------------------------------------------------------------------- mixed precision
@pytest.fixture
def one_process_group(tmp_path):
    """A world of one gloo process in this process (fully_shard needs a process group), destroyed afterwards."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("precision, compute_dtype", [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_fsdp2_computes_in_bf16_and_keeps_fp32_shards_and_gradients_under_bf16_mixed(tmp_path, one_process_group,
                                                                                      precision, compute_dtype):
    # Without a MixedPrecisionPolicy FSDP2 all-gathers and computes the fp32 shards (and reduce-scatters fp32
    # gradients) under bf16-mixed: autocast then casts every weight again in every matmul.
    config = tiny_config(tmp_path, "trainer.strategy=fsdp2")
    tokenizer, model_config, datamodule = prepare(config)
    module = MLMPretrainingModule(config, model_config, tokenizer)
    module._device_mesh = one_process_group
    module._trainer = SimpleNamespace(precision=precision)
    module.configure_model()
    seen = []
    block = module.model.model.transformer_encoder[0]
    block.register_forward_pre_hook(lambda mod, args: seen.append({p.dtype for p in mod.parameters()}))
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    batch.pop("data_state", None)
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):  # as Lightning's plugin does
        loss = module(batch).loss
    loss.backward()
    assert seen == [{compute_dtype}]  # the gathered weights a block computes with
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}  # the shards: the optimizer's masters
    assert {p.grad.dtype for p in module.model.parameters() if p.grad is not None} == {torch.float32}
