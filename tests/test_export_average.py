"""Export of averaged checkpoints (`--average last:N` or paths) and of the EMA weight set (`--weights ema`)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from experiments.export import main as export_main
from neobert.errors import CheckpointError
from neobert.jobs.export import average_state_dicts, export_from_checkpoint, select_checkpoints
from neobert.jobs.pretrain import run_pretraining
from neobert.lit.checkpoints import EMA_STATE_KEY
from tests.test_pretrain import tiny_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run keeping a checkpoint at every one of its 4 steps, with an EMA."""
    tmp = tmp_path_factory.mktemp("avg")
    config = tiny_config(tmp, "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=1",
                         "trainer.keep_checkpoints=-1", "trainer.ema.decay=0.5")
    run_pretraining(config)
    return Path(config.output_dir)


def model_weights(path: Path) -> dict:
    return {k.removeprefix("model."): v for k, v in torch.load(path, weights_only=False)["state_dict"].items()}


def test_last_n_averages_the_highest_steps_by_hand(run, tmp_path):
    chosen = select_checkpoints(run, ["last:3"])
    assert [p.name for p in chosen] == ["step-00000002.ckpt", "step-00000003.ckpt", "step-00000004.ckpt"]
    assert select_checkpoints(run / "checkpoints", ["last:3"]) == chosen
    out = export_main([str(run), str(tmp_path / "avg"), "--average", "last:3"])
    exported = load_file(out / "model.safetensors")
    by_hand = [model_weights(p) for p in chosen]
    for key, value in exported.items():
        torch.testing.assert_close(value, sum(state[key] for state in by_hand) / 3)
    record = json.loads((out / "averaging.json").read_text())
    assert [c["step"] for c in record["checkpoints"]] == [2, 3, 4] and record["weights"] == "raw"
    assert not torch.equal(exported["decoder.weight"], by_hand[-1]["decoder.weight"])  # not just the last one


def test_selection_and_mismatch_errors_name_what_is_wrong(run, tmp_path):
    with pytest.raises(CheckpointError, match="holds 4 step checkpoint"):
        select_checkpoints(run, ["last:99"])
    with pytest.raises(CheckpointError, match="last:N"):
        select_checkpoints(run, ["last:x"])
    with pytest.raises(CheckpointError, match="does not exist"):
        select_checkpoints(run, [str(tmp_path / "nope.ckpt")])
    a = {"w": torch.ones(2), "n": torch.tensor([1])}
    with pytest.raises(CheckpointError, match="'extra'"):
        average_state_dicts([a, {**a, "extra": torch.ones(1)}], ["a.ckpt", "b.ckpt"])
    with pytest.raises(CheckpointError, match="'w' has shape"):
        average_state_dicts([a, {**a, "w": torch.ones(3)}], ["a.ckpt", "b.ckpt"])
    with pytest.raises(CheckpointError, match="integer entry 'n'"):
        average_state_dicts([a, {**a, "n": torch.tensor([2])}], ["a.ckpt", "b.ckpt"])
    half = average_state_dicts([a, {**a, "w": torch.zeros(2, dtype=torch.float32)}], ["a", "b"])
    assert torch.equal(half["w"], torch.full((2,), 0.5)) and torch.equal(half["n"], a["n"])


def test_ema_weights_export_alone_or_averaged(run, tmp_path):
    last = run / "checkpoints" / "step-00000004.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    assert set(checkpoint[EMA_STATE_KEY]) == set(checkpoint["state_dict"])
    out = export_from_checkpoint(last, tmp_path / "ema", weights="ema")
    exported = load_file(out / "model.safetensors")
    for key, value in exported.items():
        torch.testing.assert_close(value, checkpoint[EMA_STATE_KEY]["model." + key])
    assert any(not torch.equal(exported[k], checkpoint["state_dict"]["model." + k]) for k in exported)
    # The run's own export/ema is the EMA of its last step.
    own = load_file(run / "export" / "ema" / "model.safetensors")
    for key, value in own.items():
        torch.testing.assert_close(value, exported[key])
    # A checkpoint without an EMA says what is missing.
    del checkpoint[EMA_STATE_KEY]
    torch.save(checkpoint, tmp_path / "no_ema.ckpt")
    with pytest.raises(CheckpointError, match="no EMA weights.*trainer.ema"):
        export_from_checkpoint(tmp_path / "no_ema.ckpt", tmp_path / "x", weights="ema")
    # A hand-made EMA entry is exported as it is.
    checkpoint[EMA_STATE_KEY] = {k: v * 0.5 for k, v in checkpoint["state_dict"].items()}
    torch.save(checkpoint, tmp_path / "half.ckpt")
    halved = load_file(export_from_checkpoint(tmp_path / "half.ckpt", tmp_path / "h", weights="ema") / "model.safetensors")
    torch.testing.assert_close(halved["decoder.weight"], checkpoint["state_dict"]["model.decoder.weight"] * 0.5)


def test_an_export_never_mixes_with_an_earlier_one(run, tmp_path, capsys):
    from neobert.jobs.cli import run_cli

    target = tmp_path / "export"
    export_main([str(run), str(target), "--average", "last:2"])
    averaged = load_file(target / "model.safetensors")
    before = sorted(p.name for p in target.iterdir())
    last = run / "checkpoints" / "last.ckpt"
    # refused without --overwrite: one line, status 2, the directory untouched (it used to be overwritten in place,
    # keeping the earlier averaging.json beside weights it no longer describes)
    assert run_cli(export_main, [str(last), str(target)]) == 2
    err = capsys.readouterr().err
    assert f"export directory {target} is not empty (it holds averaging.json, config.json" in err
    assert "pass --overwrite to replace it as a whole" in err
    assert sorted(p.name for p in target.iterdir()) == before
    # a failing export with --overwrite leaves the earlier one whole
    (tmp_path / "broken.ckpt").write_bytes(b"not a checkpoint")
    assert run_cli(export_main, [str(tmp_path / "broken.ckpt"), str(target), "--overwrite"]) == 2
    assert torch.equal(load_file(target / "model.safetensors")["decoder.weight"], averaged["decoder.weight"])
    # --overwrite replaces it as a whole: no averaging.json from the earlier export
    export_main([str(last), str(target), "--overwrite"])
    assert not (target / "averaging.json").exists()
    assert torch.equal(load_file(target / "model.safetensors")["decoder.weight"],
                       model_weights(last)["decoder.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.ckpt", "export"]  # no .tmp or .old left
