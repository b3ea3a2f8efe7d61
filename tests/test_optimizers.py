"""optimizer.name beyond AdamW: StableAdamW (torch-optimi) and Muon (torch.optim.Muon on the hidden matrices, AdamW
on the rest), in every job through neobert.lit.optim: the parameter split by name, training and exact resume
through Lightning, and the combinations that cannot work refused with one line naming the key."""

from __future__ import annotations

import pytest
import torch
from test_pretrain import crash_and_resume
from transformers import BertConfig, BertForSequenceClassification

from neobert.config import ConfigError, OptimizerConfig, load_config
from neobert.config.glue import GlueConfig
from neobert.config.pretrain import PretrainConfig
from neobert.lit.optim import MuonWithAdamW, build_optimizer, muon_split
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM, NeoBERTForSequenceClassification


def test_muon_takes_the_hidden_matrices_of_neobert_and_adamw_the_rest():
    muon, adamw = muon_split(NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny")))
    assert sorted(muon) == [f"model.transformer_encoder.{i}.{name}.weight" for i in (0, 1)
                            for name in ("ffn.w12", "ffn.w3", "qkv", "wo")]
    assert sorted(adamw) == ["decoder.bias", "decoder.weight", "model.encoder.weight", "model.layer_norm.weight",
                             *[f"model.transformer_encoder.{i}.{norm}_norm.weight" for i in (0, 1)
                               for norm in ("attention", "ffn")]]
    classifier = NeoBERTForSequenceClassification(NeoBERTConfig.from_preset("tiny"))
    assert not any(name.startswith(("dense", "classifier")) for name in muon_split(classifier)[0])


def test_muon_takes_the_hidden_matrices_of_a_hugging_face_bert():
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=100))
    muon, adamw = muon_split(model)
    per_layer = ["attention.output.dense", "attention.self.key", "attention.self.query", "attention.self.value",
                 "intermediate.dense", "output.dense"]
    assert sorted(muon) == [f"bert.encoder.layer.{i}.{name}.weight" for i in (0, 1) for name in per_layer]
    assert {"bert.pooler.dense.weight", "classifier.weight", "bert.embeddings.word_embeddings.weight"} <= set(adamw)
    assert all(p.ndim == 2 for p in muon.values())


def test_the_combined_optimizer_steps_both_groups_and_round_trips_its_state():
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    optimizer = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-3, muon_lr=2e-3))
    assert isinstance(optimizer, MuonWithAdamW)
    assert [g["lr"] for g in optimizer.param_groups][0] == 2e-3 and optimizer.param_groups[-1]["lr"] == 1e-3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(5, 1000, (2, 12))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n != "decoder.bias")
    state = optimizer.state_dict()
    again = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-3, muon_lr=2e-3))
    again.load_state_dict(state)
    momentum = next(iter(again.muon.state.values()))["momentum_buffer"]
    assert torch.equal(momentum, next(iter(optimizer.muon.state.values()))["momentum_buffer"])


def test_stable_adamw_never_picks_triton_kernels_for_cpu_parameters(monkeypatch):
    """On a machine with Triton and CUDA, torch-optimi ran its Triton kernels on CPU parameters and
    failed. Here Triton is reported present as on such a machine; the Triton kernels must never be reached, also
    after loading a state written by a GPU run (its groups say triton=True)."""
    import optimi.utils

    monkeypatch.setattr(optimi.utils, "HAS_TRITON", True)  # what _default_to_triton reads on a GPU machine
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", vocab_size=50, max_length=16))
    config = OptimizerConfig(name="stable_adamw", lr=1e-3)
    optimizer = build_optimizer(model, config)
    ids = torch.randint(5, 50, (2, 8))

    def step() -> None:
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()

    step()
    assert [group["triton"] for group in optimizer.param_groups] == [False] * len(optimizer.param_groups)
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group["triton"] = True  # as a run on the GPU saved it
    optimizer = build_optimizer(model, config)
    optimizer.load_state_dict(state)
    step()
    assert not any(group["triton"] for group in optimizer.param_groups)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stable_adamw", "muon"])
def test_a_run_resumes_exactly_with_each_optimizer(tmp_path, name):
    overrides = [f"optimizer.name={name}", "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2",
                 "data.num_workers=2", "trainer.accumulate_grad_batches=2", "trainer.ema.decay=0.5"]
    straight, _, second = crash_and_resume(tmp_path, overrides, crash_at=3)
    assert len(second.batches) == 4  # steps 2 and 3
    assert second.losses == pytest.approx(straight.losses[4:], abs=1e-6)
    assert straight.losses[-1] < straight.losses[0]


def test_combinations_that_cannot_work_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"'optimizer.name': must be one of \('adamw', 'adam', 'stable_adamw', "
                                          r"'muon'\)"):
        load_config(PretrainConfig, None, ["optimizer.name=lion"])
    for strategy in ("deepspeed_stage_2", "fsdp2"):
        with pytest.raises(ConfigError, match=rf"'optimizer.name': muon needs every hidden matrix whole on each "
                                              rf"rank, and trainer.strategy={strategy} shards the parameters"):
            load_config(PretrainConfig, None, ["optimizer.name=muon", f"trainer.strategy={strategy}"])
    with pytest.raises(ConfigError, match="'optimizer.name': muon needs"):
        load_config(GlueConfig, None, ["optimizer.name=muon", "trainer.strategy=deepspeed_stage_2"])
    with pytest.raises(ConfigError, match="'optimizer.muon_momentum': must be in"):
        load_config(PretrainConfig, None, ["optimizer.muon_momentum=1.5"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stable_adamw", "muon"])
def test_ddp_on_two_processes_trains_and_checkpoints_with_each_optimizer(tmp_path, name):
    # DDP averages the gradients, then every rank steps its own optimizer (Muon orthogonalises the averaged
    # gradient's momentum, whole matrices on every rank); the checkpoint holds the optimizer's state.
    import os
    import signal
    import subprocess

    from test_pretrain_slow import cli, write_yaml

    config = write_yaml(tmp_path, f"optimizer.name={name}", "trainer.strategy=ddp", "trainer.devices=2",
                        "trainer.max_steps=2")
    proc = cli("--config", str(config), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the 2-process DDP run did not finish in 600 s:\n{out[-5000:]}")
    assert proc.returncode == 0, out[-3000:]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2
    (optimizer_state,) = checkpoint["optimizer_states"]
    if name == "muon":
        assert set(optimizer_state) == {"muon", "adamw"} and optimizer_state["muon"]["state"]
    else:
        assert optimizer_state["state"]
