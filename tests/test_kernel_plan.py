"""One authority for which kernels run: the model's `kernel_plan` (neobert.model.kernels), which its forward pass
follows layer by layer and the preflight reports for the GPU a run is planned for (CUDA mocked: the capability the
rules read, the packages they find, tensors that say they are on a GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from neobert.config import load_config
from neobert.config.pretrain import PretrainConfig
from neobert.instruments.preflight import preflight_report
from neobert.instruments.preflight_kernels import planned_run, training_plan
from neobert.model import NeoBERTConfig, attention, kernels
from neobert.model import config as model_config_module

EIGHT_GPUS = ("trainer.devices=8", "trainer.num_nodes=1")


def cuda_tensor(dtype=torch.bfloat16):
    """What the forward's kernel checks read of a CUDA tensor."""
    return types.SimpleNamespace(is_cuda=True, dtype=dtype, stride=lambda dim: 1,
                                 device=types.SimpleNamespace(type="cuda"))


def forward_choices(model_config: NeoBERTConfig, compiled: bool = False) -> tuple[str, str]:
    """(the packed attention kernel, the MLP's kernel) the forward pass takes for a bf16 training step on the GPU the
    mocks describe, in a compiled block or not: the calls its layers make (`attend`'s and `SwiGLU.forward`'s)."""
    widths = (model_config.hidden_size, model_config.ffn_hidden_size)
    if compiled:  # what the layers read while Dynamo traces a compiled block
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            return forward_choices(model_config)
    attention_kernel = attention.chosen_packed_kernel(model_config.attention_kernel, "cuda", torch.bfloat16,
                                                      model_config.dropout, model_config.head_dim, True)
    mlp = ("quack" if kernels.use_quack(model_config.kernels, cuda_tensor(), widths)
           else "liger" if kernels.use_liger(model_config.kernels, cuda_tensor()) else "eager")
    return attention_kernel, mlp


def on_a_gpu(monkeypatch, capability: tuple[int, int], packages: bool) -> None:
    monkeypatch.setattr(kernels, "cuda_capability", lambda: capability)
    monkeypatch.setattr(attention, "cuda_capability", lambda: capability)
    for flag in ("_HAS_FLASH_ATTN", "_HAS_FLASH_ATTN_3", "_HAS_XFORMERS"):
        monkeypatch.setattr(attention, flag, False)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", packages)
    monkeypatch.setattr(attention, "_flash_attn_4_usable", lambda: packages)
    monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: None)
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)


def recipe_and_model(*overrides: str):
    from neobert.data.tokenizer import load_tokenizer
    from neobert.jobs.pretrain import build_model_config

    config = load_config(PretrainConfig, "neobert", [*EIGHT_GPUS, "trainer.strategy=ddp", *overrides])
    return config, build_model_config(config, load_tokenizer(config.data.tokenizer))


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (6, 1)])
@pytest.mark.parametrize("packages", [True, False])
@pytest.mark.parametrize("overrides", [("model.overrides.kernels=quack",), ("model.overrides.kernels=liger",)])
def test_the_preflight_and_the_forward_pass_agree_on_the_plan(monkeypatch, capability, packages, overrides):
    """The preflight's plan for a GPU of this capability is what the forward runs there: the attention kernel and the
    MLP's (QuACK only on sm80 or later, where its GEMMs take the widths), with or without the optional packages."""
    on_a_gpu(monkeypatch, capability, packages)
    config, model_config = recipe_and_model(*overrides)
    plan = training_plan(config, model_config, capability)
    # model.compile=auto: compiled by blocks from Hopper on (planned on a machine without a GPU: with the Triton
    # PyTorch's CUDA build brings)
    compiled = planned_run(config, capability).model.compile
    assert compiled is (capability >= (9, 0))
    assert (plan.attention, plan.mlp) == forward_choices(model_config, compiled)
    widths = (model_config.hidden_size, model_config.ffn_hidden_size)
    assert (plan.mlp == "quack") == (model_config.kernels == "quack" and capability[0] >= 8
                                     and all(width % 8 == 0 for width in widths))
    assert (plan.attention == "flash_attn_4") == (packages and capability[0] in (9, 10))
    # FlashAttention's kernels need sm80: before it, attention runs SDPA over a padded grid
    assert (plan.attention == "varlen_attn") == (capability[0] >= 8 and (not packages or capability[0] == 8))
    assert (plan.attention == "padded_sdpa") == (capability < (8, 0))


def test_a_width_quack_does_not_take_runs_eager_in_both(monkeypatch):
    on_a_gpu(monkeypatch, (9, 0), True)
    config, model_config = recipe_and_model("model.overrides.kernels=quack", "model.overrides.hidden_size=780",
                                            "model.overrides.num_attention_heads=6")
    assert model_config.hidden_size % 8
    assert training_plan(config, model_config, (9, 0)).mlp == "eager" == forward_choices(model_config)[1]
    assert "QuACK's GEMMs take widths that are multiples of 8" in preflight_report(config).text()


def test_on_a_cpu_the_plan_is_the_eager_model_whatever_the_choices(monkeypatch):
    on_a_gpu(monkeypatch, (9, 0), True)
    model_config = NeoBERTConfig.from_preset("tiny", kernels="liger", fused_mlm_loss=True)
    plan = kernels.kernel_plan(model_config, "cpu", torch.bfloat16)
    assert plan == kernels.KernelPlan("padded_sdpa", "eager", "eager", False)


def test_a_rule_changed_in_the_model_changes_the_forward_and_the_preflight_alike(monkeypatch):
    on_a_gpu(monkeypatch, (9, 0), True)
    config, model_config = recipe_and_model("model.overrides.kernels=quack", "model.overrides.fused_mlm_loss=true")
    assert training_plan(config, model_config, (9, 0)).mlp == "quack" == forward_choices(model_config)[1]
    assert training_plan(config, model_config, (9, 0)).fused_loss
    monkeypatch.setattr(kernels, "quack_takes", lambda dtype, widths, capability=None: False)
    assert training_plan(config, model_config, (9, 0)).mlp == "eager" == forward_choices(model_config)[1]
    monkeypatch.setattr(kernels, "fuses_mlm_loss", lambda *args: False)
    assert not training_plan(config, model_config, (9, 0)).fused_loss
    monkeypatch.setattr(attention, "_flash_attn_4_runs", lambda generation, head_dim: False)
    assert training_plan(config, model_config, (9, 0)).attention == "varlen_attn" == forward_choices(model_config)[0]


def test_a_pre_ampere_gpu_is_refused_bf16_naming_the_precision_that_would_work(monkeypatch):
    """A GTX 1080 (compute capability 6.1) has no bf16, which autocast refuses at the first step, and no FlashAttention
    kernel: the preflight refuses trainer.precision in one line naming what works, and plans no varlen kernel."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu = "NVIDIA GeForce GTX 1080"
    report = preflight_report(load_config(PretrainConfig, "neobert", list(EIGHT_GPUS)), gpu)
    [(key, why)] = report.refusals
    assert key == "trainer.precision"
    assert why == (f"bf16-mixed computes in bfloat16, which the {gpu} (compute capability 6.1) does not support (it "
                   f"needs 8.0, Ampere, or later): set trainer.precision=16-mixed or 32-true")
    text = preflight_report(load_config(PretrainConfig, "neobert", [*EIGHT_GPUS, "trainer.precision=16-mixed"]),
                            gpu).text()
    assert "PyTorch's varlen_attn" not in text
    assert "SDPA over the documents scattered into a padded grid" in text
    assert "nor whether its kernels and precision run on it" not in text  # its capability is known
    assert not preflight_report(load_config(PretrainConfig, "neobert", list(EIGHT_GPUS))).refusals  # an H100


def test_the_compile_modes_that_record_cuda_graphs_are_torchs_in_the_model_and_the_schema():
    """The model owns them (it compiles); the schema, below the model, states them for its checks: both are the modes
    torch's own table records CUDA graphs in."""
    from torch._inductor import list_mode_options

    from neobert.config.pretrain import COMPILE_MODES, CUDA_GRAPH_MODES

    recording = tuple(mode for mode in COMPILE_MODES if list_mode_options(mode).get("triton.cudagraphs"))
    assert kernels.CUDA_GRAPH_MODES == CUDA_GRAPH_MODES == recording
    for mode, without in kernels.WITHOUT_CUDA_GRAPHS.items():
        assert list_mode_options(without) == {k: v for k, v in list_mode_options(mode).items()
                                              if k != "triton.cudagraphs"}
