"""model.compile=auto: the paper's recipes (neobert, neobert-4096) compile by blocks where the model's rule says it pays
(`neobert.model.kernels.compile_pays`: a CUDA GPU of compute capability 9.0 or later with Triton), and train eager
elsewhere exactly as model.compile=false does; the run, the GPU-node check and the preflight decide it alike; the first
optimizer step's wall time is logged (CUDA mocked: the capability the rule reads, Triton's presence)."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from test_configs_packaged import schema_for
from test_pretrain import tiny_config

from neobert.config import ConfigError, config_path, load_config, packaged_config_names
from neobert.config.pretrain import PretrainConfig
from neobert.instruments import preflight_kernels
from neobert.instruments.preflight import preflight_report
from neobert.jobs import pretrain as pretrain_job
from neobert.jobs.pretrain import decide_compile, prepare, run_pretraining
from neobert.layout import metrics_csvs
from neobert.lit.pretrain import MLMPretrainingModule
from neobert.model import kernels

EIGHT_GPUS = ("trainer.devices=8", "trainer.num_nodes=1")
H100, A100, B200 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA B200"


def recipe(name: str = "neobert", *overrides: str) -> PretrainConfig:
    return load_config(PretrainConfig, name, [*EIGHT_GPUS, *overrides])


def with_triton(monkeypatch, installed: bool = True) -> None:
    for module in (kernels, preflight_kernels):
        monkeypatch.setattr(module, "triton_installed", lambda: installed)


@pytest.mark.parametrize("name", ["neobert", "neobert-4096"])
@pytest.mark.parametrize("device, capability, triton, compiled", [
    ("cuda", (9, 0), True, True),  # H100, H200
    ("cuda", (10, 0), True, True),  # B200
    ("cuda", (9, 0), False, False),  # no Triton
    ("cuda", (8, 0), True, False),  # A100
    ("cpu", None, True, False),
])
def test_the_recipes_compile_by_blocks_from_hopper_on_and_are_eager_as_before_elsewhere(monkeypatch, name, device,
                                                                                       capability, triton, compiled):
    with_triton(monkeypatch, triton)
    config = recipe(name)
    assert (config.model.compile, config.model.compile_scope, config.data.static_shapes) == ("auto", "blocks", "auto")
    decided = decide_compile(config, device, capability)
    assert kernels.compile_pays(device, capability) is compiled
    if compiled:
        assert (decided.model.compile, decided.model.compile_scope, decided.data.static_shapes) == (True, "blocks",
                                                                                                  "true")
        assert decided.data.packing == "none"  # the paper's truncated rows, unpadded to documents
    else:  # the eager run of model.compile=false, key for key
        assert decided == recipe(name, "model.compile=false", "model.compile_scope=model")
    assert config.model.compile == "auto" and config.data.static_shapes == "auto"  # a copy: the given stays
    decided.validate()


@pytest.mark.parametrize("setting", ["true", "false"])
@pytest.mark.parametrize("device, capability", [("cuda", (9, 0)), ("cuda", (8, 0)), ("cpu", None)])
def test_true_and_false_are_kept_on_every_device(monkeypatch, setting, device, capability):
    with_triton(monkeypatch)
    scope = "model.compile_scope=blocks" if setting == "true" else "model.compile_scope=model"
    config = recipe("neobert", f"model.compile={setting}", scope)
    assert decide_compile(config, device, capability) is config
    assert config.model.compile is (setting == "true")


@pytest.mark.parametrize("value", ["auto", "AUTO", "True", "false"])
def test_the_schema_reads_auto_and_the_booleans(tmp_path, value):
    config = tiny_config(tmp_path, f"model.compile={value}")
    assert config.model.compile == {"auto": "auto", "true": True, "false": False}[value.lower()]
    assert PretrainConfig().model.compile is False  # the default: every other config is unchanged


def test_a_value_that_is_not_a_setting_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.compile.*true, false or auto, got 'sometimes'"):
        tiny_config(tmp_path, "model.compile=sometimes")
    with pytest.raises(ConfigError, match=r"model\.compile.*true, false or auto, got 2"):
        tiny_config(tmp_path, "model.compile=2")


def test_under_auto_the_mode_and_scope_are_allowed_and_static_shapes_wait_for_the_decision(tmp_path):
    config = tiny_config(tmp_path, "model.compile=auto", "model.compile_scope=blocks", "data.packing=best_fit",
                         "model.compile_mode=max-autotune-no-cudagraphs")
    assert config.data.static_shapes == "auto"
    assert decide_compile(config, "cpu").data.static_shapes == "false"


def inherits_neobert(name: str) -> bool:
    """Whether a shipped config is neobert.yaml or inherits it."""
    path = config_path(name)
    while path.name != "neobert.yaml" or path.parent != config_path("neobert").parent:
        parent = OmegaConf.load(path).get("inherit")
        if parent is None:
            return False
        path = (path.parent / parent).resolve()
    return True


def test_only_the_neobert_recipe_and_what_inherits_it_say_auto():
    """Every other shipped pretraining config (the demo, the ablations, cpu-phases) resolves as before: model.compile
    false, and the same config on a Hopper GPU."""
    names = [name for name in packaged_config_names() if schema_for(name) is PretrainConfig]
    saying_auto = set()
    for name in names:
        config = load_config(PretrainConfig, name)
        if config.model.compile == "auto":
            saying_auto.add(name)
        else:
            assert config.model.compile is False, name
            assert decide_compile(config, "cuda", (9, 0)) is config
    assert {"neobert", "neobert-4096"} <= saying_auto
    assert saying_auto == {name for name in names if inherits_neobert(name)}
    assert "demo" not in saying_auto


def test_the_module_never_takes_auto_for_true(tmp_path):
    config = tiny_config(tmp_path, "model.compile=auto")
    tokenizer, model_config, _ = prepare(config)
    with pytest.raises(ValueError, match="decides auto for its device"):
        MLMPretrainingModule(config, model_config, tokenizer)


@pytest.mark.parametrize("gpu, triton, words", [
    (H100, True, "model.compile=auto: compiled (compile_scope=blocks, compile_mode=default): compute capability 9.0 "
                 "(Hopper or later) and Triton installed"),
    (B200, True, "model.compile=auto: compiled (compile_scope=blocks, compile_mode=default): compute capability 10.0 "
                 "(Hopper or later) and Triton installed"),
    (A100, True, "model.compile=auto: eager, as model.compile=false: compute capability 8.0, before Hopper's 9.0"),
    # planned on a machine without a GPU (or Triton): the GPU's machine has PyTorch's CUDA build, which brings it
    (H100, False, "model.compile=auto: compiled (compile_scope=blocks, compile_mode=default): compute capability 9.0 "
                  "(Hopper or later) and Triton installed (there: PyTorch's CUDA build brings Triton; this machine has "
                  "none)"),
    ("NVIDIA Unlisted 9000", True, "model.compile=auto: eager, as model.compile=false: the named GPU's compute "
                                   "capability is not known here"),
])
def test_the_preflight_says_which_path_the_recipe_takes_on_the_named_gpu_and_why(monkeypatch, gpu, triton, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with_triton(monkeypatch, triton)
    text = preflight_report(recipe("neobert", "trainer.strategy=ddp"), gpu).text()
    assert f"- {words}" in text
    compiled = "model.compile=auto: compiled" in words
    assert ("- torch.compile, mode default: each encoder block on its own (one shared graph)" in text) is compiled
    assert ("Inductor's fused kernels" in text) is compiled


def test_on_a_machine_with_its_gpu_the_preflight_asks_for_its_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(preflight_kernels, "planned_capability", lambda gpu: None)
    monkeypatch.setattr(pretrain_job, "cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(kernels, "cuda_capability", lambda: (9, 0))
    with_triton(monkeypatch, False)
    config = recipe("neobert", "trainer.strategy=ddp")
    assert preflight_kernels.auto_compile_words(config, None) == (
        "model.compile=auto: eager, as model.compile=false: Triton is not installed (Inductor writes its GPU kernels "
        "in it; PyTorch's CUDA wheels bring it)")
    assert preflight_kernels.planned_run(config, None).model.compile is False


def test_the_preflight_of_true_and_false_says_nothing_of_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for setting, scope in (("true", "blocks"), ("false", "model")):
        text = preflight_report(recipe("neobert", "trainer.strategy=ddp", f"model.compile={setting}",
                                       f"model.compile_scope={scope}"), H100).text()
        assert "model.compile=auto" not in text
        assert ("- torch.compile, mode default" in text) is (setting == "true")


class ModuleProbe(L.Callback):
    def __init__(self):
        self.compiled_blocks = None

    def on_train_start(self, trainer, pl_module):
        blocks = pl_module.model.model.transformer_encoder
        self.compiled_blocks = [block._compiled_call_impl is not None for block in blocks]


def first_step_values(output_dir) -> list[float]:
    values = []
    for path in metrics_csvs(output_dir):
        with open(path, newline="") as handle:
            values += [float(row["train/first_step_s"]) for row in csv.DictReader(handle)
                       if row.get("train/first_step_s")]
    return values


def test_checkpoints_move_between_the_eager_and_the_compiled_path_and_the_first_step_is_logged(tmp_path, monkeypatch,
                                                                                              caplog):
    """auto trains eager on a CPU, then resumes compiled by blocks where the rule says it pays (mocked: a Hopper GPU;
    Dynamo with its eager backend, no code generation), then eager again with model.compile=false: the same state-dict
    keys each way (strict loading). Each run logs its first optimizer step's wall time, once."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: real_compile(fn, backend="eager",
                                                                              dynamic=kw.get("dynamic")))
    torch._dynamo.reset()
    keys = ("model.compile=auto", "model.compile_scope=blocks", "trainer.checkpoint_every_n_steps=2")
    probes = []
    for steps, hopper, extra in ((2, False, ()), (4, True, ("resume=true",)),
                                 (6, False, ("resume=true", "model.compile=false", "model.compile_scope=model"))):
        monkeypatch.setattr(pretrain_job, "compile_pays", lambda *args, pays=hopper: pays)
        monkeypatch.setattr(pretrain_job, "eager_reason", lambda *args, pays=hopper:
                            None if pays else kernels.eager_reason(*args))
        monkeypatch.setattr(pretrain_job, "cuda_capability", lambda: (9, 0))
        probes.append(ModuleProbe())
        caplog.clear()
        with caplog.at_level("INFO"):
            run_pretraining(tiny_config(tmp_path, *keys, f"trainer.max_steps={steps}", *extra),
                            extra_callbacks=[probes[-1]])
        assert sum("the first optimizer step took" in record.getMessage() for record in caplog.records) == 1
        decision = [record.getMessage() for record in caplog.records if "model.compile=auto" in record.getMessage()]
        assert decision == ([] if "model.compile=false" in extra else
                            ["model.compile=auto: compiled (compile_scope=blocks, compile_mode=default): compute "
                             "capability 9.0 (Hopper or later) and Triton installed (model.compile=false trains eager)"]
                            if hopper else ["model.compile=auto: eager, as model.compile=false: a cpu device (auto "
                                            "compiles on CUDA GPUs of compute capability 9.0, Hopper, or later) "
                                            "(model.compile=false trains eager)"])
    assert [all(p.compiled_blocks) for p in probes] == [False, True, False]
    assert [any(p.compiled_blocks) for p in probes] == [False, True, False]
    first_steps = first_step_values(tmp_path / "run")
    assert len(first_steps) == 3 and all(value > 0 for value in first_steps)
