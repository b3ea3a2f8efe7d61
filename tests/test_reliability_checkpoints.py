"""Checkpoints that survive interruptions, and runs that stop on a non-finite loss:
atomic writes (temporary file in the same directory + rename), resume from the newest checkpoint that loads
(the fallback logged in one line, an error naming every file when none loads), and a NaN/inf loss stopping the
run on its step with the data position, without writing over the last good checkpoint. The kill -9 runs are in
test_pretrain_slow.py."""

import errno
import logging
import os
from pathlib import Path

import lightning as L
import pytest
import torch

from neobert.errors import CheckpointError
from neobert.jobs.pretrain import build_callbacks, run_pretraining
from neobert.lit.checkpoints import (AtomicCheckpointIO, model_state_dict, newest_readable_checkpoint,
                                     read_lightning_checkpoint)
from neobert.lit.pretrain import NonFiniteLossError
from neobert.lit.trainer import build_trainer

from test_pretrain import Recorder, tiny_config

# 6 steps, a checkpoint every 2, all kept: step-2, step-4 (and step-6), last.ckpt the newest.
RUN = ("trainer.max_steps=6", "trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=-1")


def checkpoints_of(root: Path) -> Path:
    return root / "run" / "checkpoints"


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def corrupt(path: Path) -> None:
    """Random bytes of the same size (what a disk or a bad copy leaves)."""
    path.write_bytes(os.urandom(path.stat().st_size))


def truncate(path: Path) -> None:
    """The first half (what a writer killed mid-write leaves)."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    recorder = Recorder()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as every test (conftest), which this module-scoped run precedes
    run_pretraining(tiny_config(tmp_path_factory.mktemp("straight"), *RUN), [recorder])
    assert len(recorder.batches) == 6
    return recorder


# ---------------------------------------------------------------------------------------------- (c) atomic writes
@pytest.mark.parametrize("fails_at", ["rename", "write"])
def test_an_interrupted_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fails_at):
    io, path = AtomicCheckpointIO(), tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, path)
    previous = path.read_bytes()
    written = []

    if fails_at == "rename":  # the new checkpoint is complete under its temporary name, then the rename fails
        def replace(src, dst):
            written.append((Path(src), torch.load(src, weights_only=False)["global_step"]))
            raise OSError(errno.EIO, "simulated crash before the rename")
        monkeypatch.setattr(os, "replace", replace)
    else:  # disk full in the middle of torch.save
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            f.truncate(f.tell() // 2)
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(torch, "save", save)

    with pytest.raises(OSError, match="simulated crash|[Nn]o space left"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 4}, path)
    if fails_at == "rename":  # the temporary file was in the same directory, and complete
        assert written and written[0][0].parent == path.parent and written[0][1] == 4
        assert not written[0][0].name.endswith(".ckpt")
    monkeypatch.undo()
    assert files(path.parent) == {"last.ckpt": previous}  # no partial file, no temporary file left
    assert torch.load(path, weights_only=False)["global_step"] == 2


@pytest.mark.parametrize("strategy, atomic", [("auto", True), ("ddp", True), ("fsdp2", True),
                                              ("deepspeed_stage_2", False)])
def test_every_non_deepspeed_trainer_writes_checkpoints_atomically(tmp_path, strategy, atomic):
    config = tiny_config(tmp_path, f"trainer.strategy={strategy}")
    trainer = build_trainer(config.trainer, config.logging, config.output_dir)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO) == atomic


def test_read_lightning_checkpoint_says_missing_or_corrupt(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_lightning_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"bad.ckpt is not a readable checkpoint \(corrupt or truncated\?\)"):
        read_lightning_checkpoint(tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointError, match="has no state_dict"):
        model_state_dict({"global_step": 1}, "x.ckpt")


# ---------------------------------------------------------------------------------------------- (a) fallback
def test_newest_readable_checkpoint_order(tmp_path):
    directory = checkpoints_of(tmp_path)
    assert newest_readable_checkpoint(tmp_path / "run") == (None, [])  # no checkpoints: a new run
    directory.mkdir(parents=True)
    good = lambda step: {"state_dict": {}, "global_step": step}  # noqa: E731
    for name, step in [("last.ckpt", 4), ("step-00000002.ckpt", 2), ("step-00000004.ckpt", 4)]:
        torch.save(good(step), directory / name)
    assert newest_readable_checkpoint(tmp_path / "run") == (directory / "last.ckpt", [])
    # Killed between writing step-6 and last.ckpt: step-6 is newer than the readable last.ckpt (step 4).
    torch.save(good(6), directory / "step-00000006.ckpt")
    torch.save(good(6), directory / "step-00000006-v1.ckpt")  # Lightning's name for a re-written step
    path, skipped = newest_readable_checkpoint(tmp_path / "run")
    assert path == directory / "step-00000006-v1.ckpt"
    assert skipped == [(directory / "last.ckpt", "older (step 4) than step-00000006-v1.ckpt (step 6): the run "
                                                 "stopped between writing the two")]
    # Unreadable ones are passed over, each with its reason.
    (directory / "step-00000006-v1.ckpt").write_bytes(b"")
    torch.save({"global_step": 6}, directory / "step-00000006.ckpt")
    path, skipped = newest_readable_checkpoint(tmp_path / "run")
    assert path == directory / "last.ckpt"
    assert skipped == [(directory / "step-00000006-v1.ckpt", "empty file (0 bytes)"),
                       (directory / "step-00000006.ckpt", "not a Lightning checkpoint (no state_dict)")]


@pytest.mark.parametrize("damage, damaged, resumed_step", [
    ("corrupt", ["last.ckpt"], 4),
    ("truncated", ["last.ckpt", "step-00000004.ckpt"], 2),
])
def test_an_unreadable_last_checkpoint_falls_back_and_resumes_exactly(tmp_path, monkeypatch, caplog, uninterrupted,
                                                                      damage, damaged, resumed_step):
    replaced = []  # every checkpoint goes through os.replace from a temporary file beside it
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst, **kw: (replaced.append((Path(src), Path(dst))),
                                                               real_replace(src, dst, **kw))[1])
    first = Recorder(stop_at_step=5)
    with pytest.raises(InterruptedError):
        run_pretraining(tiny_config(tmp_path, *RUN), [first])
    directory = checkpoints_of(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt", "step-00000002.ckpt", "step-00000004.ckpt"]
    replaced = [(src, dst) for src, dst in replaced if dst.name.endswith(".ckpt")]
    assert {dst.name for _, dst in replaced} == {"last.ckpt", "step-00000002.ckpt", "step-00000004.ckpt"}
    assert all(src.parent == dst.parent == directory for src, dst in replaced)
    for name in damaged:
        (corrupt if damage == "corrupt" else truncate)(directory / name)
    damaged_bytes = {name: (directory / name).read_bytes() for name in damaged}

    second = Recorder()
    with caplog.at_level(logging.WARNING, logger="neobert.lit.checkpoints"):
        run_pretraining(tiny_config(tmp_path, *RUN, "resume=true"), [second])

    # One log line: which checkpoint, and why each newer one was skipped.
    warnings = [r.getMessage() for r in caplog.records if r.name == "neobert.lit.checkpoints"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"resume=true: resuming from {directory / f'step-{resumed_step:08d}.ckpt'}; "
                                  f"skipped {damaged[0]} (corrupt or truncated (")
    for name in damaged:
        assert f"{name} (corrupt or truncated (" in warnings[0] and f"renamed to {name}.unreadable" in warnings[0]
    # The resumed run sees exactly what the uninterrupted one saw after that step.
    assert len(second.batches) == 6 - resumed_step
    for (ids, labels), (ids_straight, labels_straight) in zip(second.batches, uninterrupted.batches[resumed_step:]):
        assert torch.equal(ids, ids_straight) and torch.equal(labels, labels_straight)
    assert second.losses == pytest.approx(uninterrupted.losses[resumed_step:], abs=1e-6)
    # The damaged files are kept aside for inspection; fresh checkpoints are written under the real names.
    for name, content in damaged_bytes.items():
        assert (directory / f"{name}.unreadable").read_bytes() == content
    assert torch.load(directory / "last.ckpt", weights_only=False)["global_step"] == 6
    assert not [p for p in directory.iterdir() if p.name.startswith(".") or "-v" in p.name]


# ---------------------------------------------------------------------------------------------- (b) none readable
class FitStarted(L.Callback):
    started = False

    def on_fit_start(self, trainer, module):
        FitStarted.started = True


def test_a_resume_with_no_readable_checkpoint_fails_naming_each(tmp_path):
    directory = checkpoints_of(tmp_path)
    directory.mkdir(parents=True)
    (directory / "last.ckpt").write_bytes(os.urandom(4096))
    torch.save({"state_dict": {}, "global_step": 2}, directory / "step-00000002.ckpt")
    truncate(directory / "step-00000002.ckpt")
    (directory / "step-00000004.ckpt").write_bytes(b"")
    before = files(directory)
    with pytest.raises(CheckpointError) as error:
        run_pretraining(tiny_config(tmp_path, "resume=true"), [FitStarted()])
    message = str(error.value)
    assert message.startswith(f"resume=true but no checkpoint in {directory} is readable: last.ckpt: corrupt or "
                              f"truncated (4096 bytes): ")
    assert "; step-00000004.ckpt: empty file (0 bytes); step-00000002.ckpt: corrupt or truncated (" in message
    assert message.endswith(f". Move them out of {directory} to start a new run there, or choose another output_dir")
    assert not FitStarted.started  # failed before any training
    assert files(directory) == before  # nothing renamed or written


# ---------------------------------------------------------------------------------------------- (d) NaN / inf
class PoisonAt(L.Callback):
    """At `step`: NaN weights (a diverged model), or an infinite loss; records the checkpoints just before."""

    def __init__(self, step: int, kind: str, directory: Path):
        self.step, self.kind, self.directory, self.before = step, kind, directory, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step != self.step or self.before is not None:
            return
        self.before = files(self.directory)
        if self.kind == "nan":
            with torch.no_grad():
                module.model.model.encoder.weight.fill_(float("nan"))
        else:
            forward = module.forward

            def infinite(batch):
                output = forward(batch)
                output.loss = output.loss + float("inf")
                return output
            module.forward = infinite


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_a_non_finite_loss_stops_the_run_on_its_step_and_saves_nothing(tmp_path, kind):
    config = tiny_config(tmp_path, *RUN)
    assert build_callbacks(config)[0].save_on_exception is False
    poison = PoisonAt(3, kind, checkpoints_of(tmp_path))
    with pytest.raises(NonFiniteLossError) as error:
        run_pretraining(config, [poison])
    assert str(error.value) == (
        f"the training loss is {kind} at global step 3: the batch came from data stream 0 (the stream's batch 4, "
        "ending at epoch 0, shuffle block 0, document 16 of the block). Training stopped before the update of "
        "global step 3 (the loss is checked every 1 steps, logging.log_every_n_steps, and before every checkpoint); "
        "nothing was saved after the last good checkpoint (resume=true restarts from it)")
    directory = checkpoints_of(tmp_path)
    assert sorted(poison.before) == ["last.ckpt", "step-00000002.ckpt"]
    assert files(directory) == poison.before  # the step-2 checkpoints, byte for byte, and nothing else
    assert torch.load(directory / "last.ckpt", weights_only=False)["global_step"] == 2


def test_a_non_finite_loss_between_log_reads_is_caught_before_the_next_checkpoint(tmp_path):
    """The step loop reads the loss only every logging.log_every_n_steps steps: a loss that turns infinite at step
    3 of a run that reads every 5 is caught when the step-4 checkpoint would be written; the error still names
    step 3 and its batch, and the step-2 checkpoints are left as they were."""
    poison = PoisonAt(3, "inf", checkpoints_of(tmp_path))
    with pytest.raises(NonFiniteLossError) as error:
        run_pretraining(tiny_config(tmp_path, *RUN, "logging.log_every_n_steps=5"), [poison])
    assert str(error.value).startswith(
        "the training loss is inf at global step 3: the batch came from data stream 0 (the stream's batch 4, ")
    assert "Training stopped before writing the checkpoint of global step 4 (the loss is checked every 5 steps" in (
        str(error.value))
    assert files(checkpoints_of(tmp_path)) == poison.before


def test_a_non_finite_loss_names_the_micro_batch_when_accumulating(tmp_path):
    config = tiny_config(tmp_path, *RUN, "trainer.accumulate_grad_batches=2")
    with pytest.raises(NonFiniteLossError, match=r"^the training loss is inf at global step 3, micro-batch 1 of 2: "
                                                 r"the batch came from data stream 0 \(the stream's batch 7, "):
        run_pretraining(config, [PoisonAt(3, "inf", checkpoints_of(tmp_path))])


def test_ctrl_c_exits_130_saying_where_the_run_stopped_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    from experiments import pretrain as pretrain_cli
    from neobert.jobs import pretrain as pretrain_job
    from neobert.jobs.cli import run_cli
    from neobert.lit.checkpoints import verify_checkpoint
    from test_pretrain_slow import write_yaml

    class CtrlC(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 3:
                raise KeyboardInterrupt

    built = pretrain_job.build_callbacks
    monkeypatch.setattr(pretrain_job, "build_callbacks", lambda config: built(config) + [CtrlC()])
    config = write_yaml(tmp_path, "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2")
    # Lightning shuts down gracefully and exits with status 1; the command line says so and exits 130
    assert run_cli(pretrain_cli.main, ["--config", str(config)]) == 130
    err = capsys.readouterr().err
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert (f"interrupted: the run stopped at global step 3; the newest checkpoint is {last} (global step 2): run "
            f"the same command with resume=true to continue from it") in err.replace("\n", " ")
    monkeypatch.setattr(pretrain_job, "build_callbacks", built)
    assert run_cli(pretrain_cli.main, ["--config", str(config), "resume=true"]) == 0
    assert verify_checkpoint(last) == 4


def test_resuming_a_run_of_another_model_size_is_one_line_and_leaves_no_log_directories(tmp_path, capsys):
    from experiments import pretrain as pretrain_cli
    from neobert.jobs.cli import run_cli
    from test_pretrain_slow import write_yaml

    config = write_yaml(tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2")
    assert run_cli(pretrain_cli.main, ["--config", str(config)]) == 0
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    argv = ["--config", str(config), "resume=true", "trainer.max_steps=4", "model.overrides.hidden_size=32"]
    assert run_cli(pretrain_cli.main, argv) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'run' / 'checkpoints' / 'last.ckpt'} holds another model than this config builds " \
           f"(dim_head 16 there, 8 here, hidden_size 64 there, 32 here): continue it with its own model settings, " \
           f"or give this run another output_dir" in err
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == logs  # no empty version_1
