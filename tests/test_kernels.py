"""NeoBERTConfig.kernels (neobert.model.kernels): the Liger path is wired where it should be and equals the eager path.

On CPU: the choice is validated, never written to config.json, refused with the key's name where Liger-Kernel is
missing, and, with Liger's two functions replaced by reference arithmetic, the model calls them at every norm and MLP
with the layout Liger expects (gate first) and gives the eager outputs. On a CUDA machine with liger-kernel: Liger's
own kernels against the eager path, outputs and gradients, padded and packed, in bf16 inference and bf16-mixed
training (the test at the bottom; it skips elsewhere).
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from neobert.config.throughput import ThroughputConfig
from neobert.model import NeoBERT, NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model import config as model_config_module
from neobert.model import layers
from neobert.model.config import ModelFieldError
from neobert.model.kernels import liger_missing_reason, use_liger


def test_kernels_is_validated():
    with pytest.raises(ValueError, match="kernels"):
        NeoBERTConfig.from_preset("tiny", kernels="fused")


def test_liger_without_the_package_is_refused_naming_the_field(monkeypatch):
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: "needs the liger-kernel package")
    with pytest.raises(ModelFieldError, match="kernels.*liger-kernel") as err:
        NeoBERTConfig.from_preset("tiny", kernels="liger")
    assert err.value.field == "kernels"


def test_pretraining_names_its_override_when_liger_is_missing(monkeypatch):
    from neobert.data.tokenizer import load_tokenizer
    from neobert.errors import ConfigError
    from neobert.jobs.pretrain import build_model_config, load_pretrain_config

    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: "needs the liger-kernel package")
    config = load_pretrain_config("demo", ["model.overrides.kernels=liger"])
    with pytest.raises(ConfigError, match=r"model\.overrides\.kernels.*liger-kernel"):
        build_model_config(config, load_tokenizer(config.data.tokenizer))


def test_kernels_are_the_machines_choice_not_written_to_config_json(tmp_path, monkeypatch):
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    model = NeoBERT(NeoBERTConfig.from_preset("tiny", kernels="liger"))
    model.save_pretrained(tmp_path)
    assert "kernels" not in json.loads((tmp_path / "config.json").read_text())
    assert NeoBERT.from_pretrained(tmp_path).config.kernels == "eager"
    assert NeoBERT.from_pretrained(tmp_path, kernels="liger").config.kernels == "liger"  # chosen at load


def test_liger_runs_on_cuda_tensors_only():
    x = torch.zeros(2, 4)
    assert not use_liger("liger", x)  # a CPU tensor: eager
    assert not use_liger("eager", x)
    assert not use_liger("liger", torch.zeros(2, 4, device="meta"))


class ReferenceLiger:
    """Liger-Kernel's two autograd Functions replaced by what they compute, with the contracts the real ones have
    (SwiGLU takes 2-D rows: its backward returns a 2-D gradient), counting calls: neobert.model.kernels and the
    model's wiring checked on CPU."""

    def __init__(self, monkeypatch):
        self.norm_calls = self.swiglu_calls = 0
        reference = self

        class RMSNormFunction:
            @staticmethod
            def apply(x, weight, eps, offset, casting_mode, in_place):
                assert (offset, casting_mode, in_place) == (0.0, "llama", False)
                reference.norm_calls += 1
                return F.rms_norm(x, (x.shape[-1],), weight, eps)

        class GateUpSiLUMulFunction:
            @staticmethod
            def apply(rows, in_place):
                assert rows.dim() == 2, "Liger's fused SwiGLU takes rows: its backward returns a 2-D gradient"
                reference.swiglu_calls += 1
                gate, up = rows.chunk(2, dim=-1)  # Liger's fused gate-up layout: gate in the first half
                return F.silu(gate) * up

        for name, attributes in (("liger_kernel", {}), ("liger_kernel.ops", {}),
                                 ("liger_kernel.ops.rms_norm", {"LigerRMSNormFunction": RMSNormFunction}),
                                 ("liger_kernel.ops.swiglu", {"LigerFusedGateUpSiLUMulFunction": GateUpSiLUMulFunction})):
            module = types.ModuleType(name)
            module.__dict__.update(attributes)
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
        monkeypatch.setattr(layers, "use_liger", lambda kernels, x: kernels == "liger")  # as on a CUDA tensor


@pytest.mark.parametrize("packed", [False, True])
def test_the_liger_path_calls_its_kernels_at_every_norm_and_mlp_and_equals_eager(monkeypatch, packed):
    reference = ReferenceLiger(monkeypatch)
    torch.manual_seed(0)
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    liger = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", kernels="liger"))
    liger.load_state_dict(eager.state_dict())
    ids = torch.randint(5, 1000, (2, 12))
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    kwargs = {"cu_seqlens": torch.tensor([0, 5, 12, 24], dtype=torch.int32), "max_seqlen": 12} if packed else {}
    outputs = []
    for model in (eager, liger):
        out = model(ids, labels=labels, **kwargs)
        out.loss.backward()
        outputs.append((out.logits, out.loss, [p.grad for p in model.parameters()]))
    layers_count = eager.config.num_hidden_layers
    assert reference.norm_calls == 2 * layers_count + 1  # attention_norm, ffn_norm per block, the final norm
    assert reference.swiglu_calls == layers_count
    (logits_e, loss_e, grads_e), (logits_l, loss_l, grads_l) = outputs
    torch.testing.assert_close(logits_l, logits_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_l, loss_e, rtol=1e-5, atol=1e-5)
    for grad_l, grad_e in zip(grads_l, grads_e):
        torch.testing.assert_close(grad_l, grad_e, rtol=1e-4, atol=1e-5)


def test_the_throughput_job_reports_why_neobert_liger_cannot_run_on_cpu():
    from neobert.eval.throughput import ModelUnavailable, build_model

    assert "neobert-liger" in ThroughputConfig().models
    with pytest.raises(ModelUnavailable, match="CUDA|liger"):
        build_model("neobert-liger", torch.device("cpu"), torch.float32, "tiny")


needs_liger_on_cuda = pytest.mark.skipif(not torch.cuda.is_available() or liger_missing_reason() is not None,
                                         reason="Liger-Kernel's Triton kernels need a CUDA GPU and liger-kernel")


@needs_liger_on_cuda
@pytest.mark.parametrize("preset", ["tiny", "neobert"])
def test_liger_kernels_equal_the_eager_path_on_cuda(preset):
    torch.manual_seed(0)
    device = torch.device("cuda")
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset(preset, attention_backend="varlen")).to(device)
    liger = NeoBERTForMaskedLM(NeoBERTConfig.from_preset(preset, attention_backend="varlen", kernels="liger"))
    liger.load_state_dict(eager.state_dict())
    liger.to(device)
    ids = torch.randint(5, 30000, (4, 256), device=device)
    labels = torch.where(torch.rand(ids.shape, device=device) < 0.2, ids, torch.full_like(ids, -100))
    cu_seqlens = torch.tensor([0, 100, 356, 700, 1024], dtype=torch.int32, device=device)
    for kwargs in ({}, {"cu_seqlens": cu_seqlens, "max_seqlen": 344}):
        results = []
        for model in (eager, liger):  # bf16-mixed training: float32 weights, bf16 matmuls, float32 residual stream
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids, labels=labels, masked_only=True, **kwargs)
            out.loss.backward()
            results.append((out.logits.float(), out.loss, [p.grad.float() for p in model.parameters()]))
        (logits_e, loss_e, grads_e), (logits_l, loss_l, grads_l) = results
        torch.testing.assert_close(loss_l, loss_e, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(logits_l, logits_e, rtol=5e-2, atol=5e-2)
        for grad_l, grad_e in zip(grads_l, grads_e):
            scale = grad_e.abs().max().clamp(min=1e-6)  # bf16 matmuls: compare relative to each tensor's scale
            assert (grad_l - grad_e).abs().max() / scale < 5e-2
    with torch.inference_mode():  # bf16 weights: each bf16 path against the float32 model, Liger's no further off
        reference = eager.model(ids).last_hidden_state.float()
        errors = [(model.to(torch.bfloat16).model(ids).last_hidden_state.float() - reference).norm() / reference.norm()
                  for model in (eager, liger)]
    assert errors[1] <= 1.5 * errors[0] + 1e-3, f"bf16 error vs float32: liger {errors[1]:.4f}, eager {errors[0]:.4f}"
