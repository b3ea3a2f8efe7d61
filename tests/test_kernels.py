"""NeoBERTConfig.kernels and fused_mlm_loss (neobert.model.kernels): the Liger path is wired where it should be and
equals the eager path. NeoBERTConfig.decoder_pad_multiple: the MLM decoder's matmul on a padded weight gives the
decoder's logits, loss and gradients. kernels="quack": QuACK's MLP is called where it should be, with the
arguments that read w12 as it is laid out (a reference in its place on CPU; QuACK's own kernels against eager on a
CUDA machine with quack-kernels).

On CPU: the choice is validated, never written to config.json, refused with the key's name where Liger-Kernel is
missing, and, with Liger's three functions replaced by reference arithmetic, the model calls them at every norm and MLP
with the layout Liger expects (gate first), and for the MLM head's masked rows in training, and gives the eager
outputs, gradients and training accuracy. On a CUDA machine with liger-kernel: Liger's
own kernels against the eager path, outputs and gradients, padded and packed, in bf16 inference and bf16-mixed
training (the test at the bottom; it skips elsewhere).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from neobert.config.throughput import ThroughputConfig
from neobert.model import NeoBERT, NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model import config as model_config_module
from neobert.model import layers, modeling
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


def test_fused_mlm_loss_is_validated_refused_without_liger_and_not_written_to_config_json(tmp_path, monkeypatch):
    with pytest.raises(ModelFieldError, match="fused_mlm_loss"):
        NeoBERTConfig.from_preset("tiny", fused_mlm_loss="yes")
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: "needs the liger-kernel package")
    with pytest.raises(ModelFieldError, match="fused_mlm_loss.*liger-kernel") as err:
        NeoBERTConfig.from_preset("tiny", fused_mlm_loss=True)
    assert err.value.field == "fused_mlm_loss"
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", fused_mlm_loss=True)).save_pretrained(tmp_path)
    assert "fused_mlm_loss" not in json.loads((tmp_path / "config.json").read_text())
    assert NeoBERTForMaskedLM.from_pretrained(tmp_path).config.fused_mlm_loss is False


def test_pretraining_names_its_override_when_liger_is_missing(monkeypatch):
    from neobert.data.tokenizer import load_tokenizer
    from neobert.errors import ConfigError
    from neobert.jobs.pretrain import build_model_config, load_pretrain_config

    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: "needs the liger-kernel package")
    for key, value in (("kernels", "liger"), ("fused_mlm_loss", "true")):
        config = load_pretrain_config("demo", [f"model.overrides.{key}={value}"])
        with pytest.raises(ConfigError, match=rf"model\.overrides\.{key}.*liger-kernel"):
            build_model_config(config, load_tokenizer(config.data.tokenizer))


class LinearShapes(torch.overrides.TorchFunctionMode):
    """Records the weight shape and dtype of every F.linear call."""

    def __init__(self):
        super().__init__()
        self.weights, self.dtypes = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.weights.append(tuple(args[1].shape))
            self.dtypes.append(args[1].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("selection", ["masked_index", "masked_only", "all positions"])
def test_a_padded_decoder_gives_the_decoders_logits_loss_and_gradients(selection):
    """decoder_pad_multiple=64: the decoder's matmul runs on 30,528 rows (tiny's vocabulary is bert-base-uncased's
    30,522), and the logits, the loss, the predictions and every gradient are the unpadded decoder's."""
    torch.manual_seed(0)
    as_is = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    padded = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", decoder_pad_multiple=64))
    padded.load_state_dict(as_is.state_dict())
    assert as_is.config.vocab_size == 30522 and padded.decoder.weight.shape == (30522, 64)  # the checkpoint's shape
    ids, labels = masked_batch()
    selected = {"masked_index": {"masked_index": (labels.reshape(-1) != -100).nonzero().squeeze(1)},
                "masked_only": {"masked_only": True}, "all positions": {}}[selection]
    outputs = []
    for model in (as_is, padded):
        with LinearShapes() as shapes:
            out = model(ids, labels=labels, **selected)
        out.loss.backward()
        outputs.append(out)
        assert shapes.weights[-1] == (30528 if model is padded else 30522, 64)  # the decoder's matmul
    (eager, ours) = outputs
    assert ours.logits.shape == eager.logits.shape and ours.logits.shape[-1] == 30522
    torch.testing.assert_close(ours.logits, eager.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.loss, eager.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.predicted_ids(), eager.predicted_ids())
    for (name, p_padded), p_as_is in zip(padded.named_parameters(), as_is.parameters()):
        assert p_padded.grad.shape == p_as_is.grad.shape
        torch.testing.assert_close(p_padded.grad, p_as_is.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_padded_linear_in_bf16_compiles_into_one_graph_and_equals_the_linear():
    torch.manual_seed(0)
    x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(13, 16, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(13, dtype=torch.bfloat16, requires_grad=True)
    expected = F.linear(x, weight, bias)
    grads = torch.autograd.grad(expected.float().square().sum(), (x, weight, bias))
    for run in (modeling.padded_linear, torch.compile(modeling.padded_linear, fullgraph=True, backend="aot_eager")):
        out = run(x, weight, bias, 8)
        assert out.shape == (6, 13)
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
        for got, want in zip(torch.autograd.grad(out.float().square().sum(), (x, weight, bias)), grads):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert modeling.padded_linear(x, weight, None, 13).shape == (6, 13)  # a multiple already, and no bias


@pytest.mark.parametrize("value", [0, -64, True, 2.5, "64"])
def test_decoder_pad_multiple_is_validated(value):
    with pytest.raises(ModelFieldError, match="decoder_pad_multiple.*positive integer") as err:
        NeoBERTConfig.from_preset("tiny", decoder_pad_multiple=value)
    assert err.value.field == "decoder_pad_multiple"


def test_decoder_padding_is_the_machines_choice_named_as_an_override_and_not_written_to_config_json(tmp_path):
    from neobert.data.tokenizer import load_tokenizer
    from neobert.errors import ConfigError
    from neobert.jobs.pretrain import build_model_config, load_pretrain_config

    NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", decoder_pad_multiple=64)).save_pretrained(tmp_path)
    assert "decoder_pad_multiple" not in json.loads((tmp_path / "config.json").read_text())
    assert NeoBERTForMaskedLM.from_pretrained(tmp_path).config.decoder_pad_multiple == 1
    config = load_pretrain_config("demo", ["model.overrides.decoder_pad_multiple=64"])
    assert build_model_config(config, load_tokenizer(config.data.tokenizer)).decoder_pad_multiple == 64
    config = load_pretrain_config("demo", ["model.overrides.decoder_pad_multiple=0"])
    with pytest.raises(ConfigError, match=r"model\.overrides\.decoder_pad_multiple.*positive integer"):
        build_model_config(config, load_tokenizer(config.data.tokenizer))
    # on in the GPU recipe (the eager head 1.36x on an H100) and the configs that inherit it; off by default (0.85x
    # on a CPU)
    assert load_pretrain_config("demo").model.overrides.get("decoder_pad_multiple", 1) == 1
    for recipe in ("neobert.yaml", "neobert-4096.yaml", "recipes/neobert-wsd.yaml"):
        config = load_pretrain_config(str(Path(__file__).parents[1] / "configs" / recipe))
        assert config.model.overrides["decoder_pad_multiple"] == 64


def test_kernels_are_the_machines_choice_not_written_to_config_json(tmp_path, monkeypatch):
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    model = NeoBERT(NeoBERTConfig.from_preset("tiny", kernels="liger"))
    model.save_pretrained(tmp_path)
    assert "kernels" not in json.loads((tmp_path / "config.json").read_text())
    assert NeoBERT.from_pretrained(tmp_path).config.kernels == "eager"
    assert NeoBERT.from_pretrained(tmp_path, kernels="liger").config.kernels == "liger"  # chosen at load


def test_transformers_auto_classes_take_the_kernels_at_load(tmp_path, monkeypatch):
    """`AutoModel.from_pretrained(dir, kernels="liger")`: the machine's choice reaches our model through transformers
    too (and, as above, is never written back)."""
    from transformers import AutoModelForMaskedLM

    import neobert  # noqa: F401 (registers the Auto classes)

    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny")).save_pretrained(tmp_path / "model")
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "model", kernels="liger")
    assert loaded.model.config.kernels == "liger"
    loaded.save_pretrained(tmp_path / "again")
    assert "kernels" not in json.loads((tmp_path / "again" / "config.json").read_text())


def test_liger_takes_only_cuda_tensors():
    x = torch.zeros(2, 4)
    assert not use_liger("liger", x)  # a CPU tensor: eager
    assert not use_liger("eager", x)
    assert not use_liger("liger", torch.zeros(2, 4, device="meta"))


class ReferenceLiger:
    """Liger-Kernel's two autograd Functions replaced by what they compute, with the contracts the real ones have
    (SwiGLU takes 2-D rows: its backward returns a 2-D gradient), counting calls: neobert.model.kernels and the
    model's wiring checked on CPU."""

    def __init__(self, monkeypatch):
        self.norm_calls = self.swiglu_calls = self.loss_calls = 0
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

        class FusedLinearCrossEntropyFunction:
            @staticmethod
            def apply(rows, weight, targets, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
                      reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
                      return_predicted_tokens):
                assert rows.dim() == 2 and targets.shape == rows.shape[:1] and weight.shape[1] == rows.shape[1]
                assert (ce_weight, lse_square_scale, label_smoothing, softcap, use_token_scaling) == (None, 0.0, 0.0,
                                                                                                       None, False)
                assert reduction == "sum" and return_predicted_tokens and not return_z_loss
                assert accum_dtype == torch.float32  # the weight's gradient summed over chunks in float32
                reference.loss_calls += 1
                logits = F.linear(rows, weight, bias)
                loss = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")
                # Liger's contract: -1 where the target is ignored, the argmax elsewhere
                predictions = torch.where(targets == ignore_index, -1, logits.detach().argmax(-1))
                return loss, None, None, predictions

        for name, attributes in (
                ("liger_kernel", {}), ("liger_kernel.ops", {}),
                ("liger_kernel.ops.rms_norm", {"LigerRMSNormFunction": RMSNormFunction}),
                ("liger_kernel.ops.swiglu", {"LigerFusedGateUpSiLUMulFunction": GateUpSiLUMulFunction}),
                ("liger_kernel.ops.fused_linear_cross_entropy",
                 {"LigerFusedLinearCrossEntropyFunction": FusedLinearCrossEntropyFunction})):
            module = types.ModuleType(name)
            module.__dict__.update(attributes)
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
        on_cuda = lambda kernels, x: kernels == "liger"  # noqa: E731 (what use_liger answers for a CUDA tensor)
        monkeypatch.setattr(layers, "use_liger", on_cuda)
        on_a_gpu = lambda fused, device_type, backward, compiling: fused and backward and not compiling  # noqa: E731
        monkeypatch.setattr(modeling, "fuses_mlm_loss", on_a_gpu)  # what the rule answers for CUDA rows


def assert_a_training_step_equals_eager(kernels: str, packed: bool) -> int:
    """One training step of the tiny model with `kernels` against the eager model with the same weights and batch
    (padded, or packed documents): the same logits, loss and gradients. Returns its number of layers."""
    torch.manual_seed(0)
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    other = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", kernels=kernels))
    other.load_state_dict(eager.state_dict())
    ids, labels = masked_batch()
    kwargs = {"cu_seqlens": torch.tensor([0, 5, 12, 24], dtype=torch.int32), "max_seqlen": 12} if packed else {}
    outputs = []
    for model in (eager, other):
        out = model(ids, labels=labels, **kwargs)
        out.loss.backward()
        outputs.append((out.logits, out.loss, [p.grad for p in model.parameters()]))
    (logits_e, loss_e, grads_e), (logits_o, loss_o, grads_o) = outputs
    torch.testing.assert_close(logits_o, logits_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_o, loss_e, rtol=1e-5, atol=1e-5)
    for grad_o, grad_e in zip(grads_o, grads_e):
        torch.testing.assert_close(grad_o, grad_e, rtol=1e-4, atol=1e-5)
    return eager.config.num_hidden_layers


@pytest.mark.parametrize("packed", [False, True])
def test_the_liger_path_calls_its_kernels_at_every_norm_and_mlp_and_equals_eager(monkeypatch, packed):
    reference = ReferenceLiger(monkeypatch)
    layers_count = assert_a_training_step_equals_eager("liger", packed)
    assert reference.norm_calls == 2 * layers_count + 1  # attention_norm, ffn_norm per block, the final norm
    assert reference.swiglu_calls == layers_count


def masked_batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1000, (2, 12), generator=generator)
    labels = torch.where(torch.rand(ids.shape, generator=generator) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    return ids, labels


def eager_and_liger_models():
    torch.manual_seed(0)
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    liger = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", kernels="liger", fused_mlm_loss=True))
    liger.load_state_dict(eager.state_dict())
    return eager, liger


@pytest.mark.parametrize("selection", ["masked_index", "masked_only"])
def test_in_training_liger_fuses_the_decoder_and_loss_and_equals_eager(monkeypatch, selection):
    """The masked rows' loss runs as Liger's fused linear cross-entropy (no logits kept): the same loss, gradients
    and predictions as the eager head. A static batch's filler entry (labelled -100) counts for nothing."""
    reference = ReferenceLiger(monkeypatch)
    eager, liger = eager_and_liger_models()
    ids, labels = masked_batch()
    if selection == "masked_index":
        index = (labels.reshape(-1) != -100).nonzero().squeeze(1)
        selected = {"masked_index": torch.cat([index, torch.tensor([1])])}  # position 1: filler, labelled -100
        assert labels.reshape(-1)[1] == -100
    else:
        selected = {"masked_only": True}
    outputs = []
    for model in (eager, liger):
        out = model(ids, labels=labels, **selected)
        out.loss.backward()
        outputs.append(out)
    assert reference.loss_calls == 1
    eager_out, liger_out = outputs
    assert liger_out.logits is None and eager_out.logits is not None
    torch.testing.assert_close(liger_out.loss, eager_out.loss, rtol=1e-5, atol=1e-6)
    scored = torch.ones(eager_out.logits.shape[0], dtype=torch.bool)
    if selection == "masked_index":
        scored[-1] = False  # the filler's prediction is -1 under Liger, an argmax under eager: never counted
    assert torch.equal(liger_out.predicted_ids()[scored], eager_out.predicted_ids()[scored])
    for (name, p_liger), p_eager in zip(liger.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p_liger.grad, p_eager.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_liger_blocks_alone_keep_the_eager_head(monkeypatch):
    """kernels="liger" without fused_mlm_loss: Liger's norms and SwiGLU, the eager decoder and cross-entropy (on the
    H200 the fused head was the slower one, docs/benchmarks.md)."""
    reference = ReferenceLiger(monkeypatch)
    torch.manual_seed(0)
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", kernels="liger"))
    ids, labels = masked_batch()
    out = model(ids, labels=labels, masked_only=True)
    out.loss.backward()
    assert out.logits is not None and reference.loss_calls == 0 and reference.norm_calls > 0


def test_liger_keeps_the_logits_where_no_backward_follows_or_nothing_is_masked(monkeypatch):
    reference = ReferenceLiger(monkeypatch)
    _, liger = eager_and_liger_models()
    ids, labels = masked_batch()
    with torch.no_grad():  # evaluation reads the logits (held-out loss, pseudo-perplexity)
        assert liger(ids, labels=labels, masked_only=True).logits is not None
    empty = liger(ids, labels=labels, masked_index=torch.zeros(0, dtype=torch.long))
    # nothing to score: no fused call with no rows
    assert empty.logits.shape[0] == 0 and float(empty.loss.detach()) == 0.0
    assert liger(ids, labels=labels).logits.shape == (*ids.shape, liger.config.vocab_size)  # full logits asked for
    assert reference.loss_calls == 0


def test_pretraining_accuracy_reads_the_fused_losss_predictions(monkeypatch):
    """The LightningModule's training accuracy is the same whether the head made logits or Liger gave its argmax:
    targets set to the model's own prediction at every other masked row make a known number right."""
    from neobert.lit.pretrain import MLMPretrainingModule

    ReferenceLiger(monkeypatch)
    eager, liger = eager_and_liger_models()
    ids, labels = masked_batch(seed=3)
    index = (labels.reshape(-1) != -100).nonzero().squeeze(1)
    with torch.no_grad():
        predicted = eager(ids, labels=labels, masked_index=index).logits.argmax(-1)
    made_right = index[::2]
    labels.view(-1)[made_right] = predicted[::2]
    counts = [MLMPretrainingModule._accuracy_counts(model(ids, labels=labels, masked_index=index), labels)
              for model in (eager, liger)]
    (correct_eager, masked_eager), (correct_liger, masked_liger) = counts
    assert int(correct_liger) == int(correct_eager) >= made_right.numel()
    assert int(masked_liger) == int(masked_eager) == index.numel()


class ReferenceQuack:
    """QuACK's `mlp_func` replaced by what it computes, checking the arguments the model passes (SwiGLU, w12's
    [gate; up] stacking read as it is, untuned), counting calls: the wiring checked on CPU."""

    def __init__(self, monkeypatch):
        self.calls = 0
        reference = self

        def mlp_func(x, weight1, weight2, activation, tuned=True, concat_layout=False):
            assert (activation, tuned, concat_layout) == ("swiglu", False, True)
            assert weight1.shape == (2 * weight2.shape[1], x.shape[-1]) and weight2.shape[0] == x.shape[-1]
            reference.calls += 1
            gate, up = F.linear(x, weight1).chunk(2, dim=-1)  # concat_layout: gate rows first, then up
            return F.linear(F.silu(gate) * up, weight2)

        for name, attributes in (("quack", {}), ("quack.mlp", {"mlp_func": mlp_func})):
            module = types.ModuleType(name)
            module.__dict__.update(attributes)
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: None)
        monkeypatch.setattr(layers, "use_quack", lambda kernels, x, widths: kernels == "quack")  # a CUDA tensor's


@pytest.mark.parametrize("packed", [False, True])
def test_the_quack_path_calls_its_mlp_in_every_block_and_equals_eager(monkeypatch, packed):
    reference = ReferenceQuack(monkeypatch)
    liger = ReferenceLiger(monkeypatch)
    assert reference.calls == 0
    assert assert_a_training_step_equals_eager("quack", packed) == reference.calls
    assert liger.norm_calls == liger.swiglu_calls == 0  # the norms stay PyTorch's


def test_quack_takes_only_cuda_tensors_compiled_or_not_and_is_refused_naming_the_field_without_its_package(
        monkeypatch, tmp_path):
    from neobert.data.tokenizer import load_tokenizer
    from neobert.errors import ConfigError
    from neobert.jobs.pretrain import build_model_config, load_pretrain_config
    from neobert.model import kernels

    assert not kernels.use_quack("quack", torch.zeros(2, 8), (8, 16))  # a CPU tensor
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    assert "quack-kernels" in kernels.quack_missing_reason()
    monkeypatch.undo()
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: "0.5.3")
    assert kernels.quack_missing_reason() == ("needs quack-kernels >= 0.6 (installed: 0.5.3; pip install -U "
                                              "quack-kernels)")
    monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: "0.6.5")
    assert kernels.quack_missing_reason() is None
    monkeypatch.undo()
    monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: "needs the quack-kernels package")
    with pytest.raises(ModelFieldError, match="'quack' needs the quack-kernels package; 'eager' runs everywhere"):
        NeoBERTConfig.from_preset("tiny", kernels="quack")
    config = load_pretrain_config("demo", ["model.overrides.kernels=quack"])
    with pytest.raises(ConfigError, match=r"model\.overrides\.kernels.*quack-kernels"):
        build_model_config(config, load_tokenizer(config.data.tokenizer))
    monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: None)
    NeoBERT(NeoBERTConfig.from_preset("tiny", kernels="quack")).save_pretrained(tmp_path)
    assert "kernels" not in json.loads((tmp_path / "config.json").read_text())


def test_quack_runs_where_its_gemms_do_and_the_eager_mlp_elsewhere(monkeypatch):
    """bf16 or fp16 computation (the tensor's dtype, or autocast's), a contiguous last dimension, widths multiples of
    8, a GPU of compute capability 8.0 or later: else the eager MLP (QuACK has no float32 GEMM on Hopper)."""
    from neobert.model import kernels

    def cuda_tensor(dtype=torch.bfloat16, last_stride=1):  # what use_quack reads of a CUDA tensor
        return types.SimpleNamespace(is_cuda=True, dtype=dtype, stride=lambda dim: last_stride)

    monkeypatch.setattr(kernels, "cuda_capability", lambda: (9, 0))
    assert kernels.use_quack("quack", cuda_tensor(), (768, 2048))
    assert kernels.use_quack("quack", cuda_tensor(torch.float16), (768, 2048))
    assert not kernels.use_quack("eager", cuda_tensor(), (768, 2048))
    assert not kernels.use_quack("quack", cuda_tensor(torch.float32), (768, 2048))  # float32 weights, no autocast
    assert not kernels.use_quack("quack", cuda_tensor(last_stride=2), (768, 2048))
    assert not kernels.use_quack("quack", cuda_tensor(), (770, 2048))
    assert not kernels.use_quack("quack", cuda_tensor(), (768, 2052))
    # float32 weights under CUDA's bf16 autocast (bf16-mixed training): bf16 GEMMs. Autocast's own switch, as it
    # reads on a GPU (a CPU-only torch turns CUDA autocast off)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: device_type == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.bfloat16)
    assert kernels.use_quack("quack", cuda_tensor(torch.float32), (768, 2048))
    monkeypatch.setattr(kernels, "cuda_capability", lambda: (7, 5))
    assert not kernels.use_quack("quack", cuda_tensor(), (768, 2048))


@pytest.mark.gpu_image  # torch 2.11's Dynamo could not compare the capability's tuple; 2.13's can
def test_quacks_check_traces_in_a_compiled_graph(monkeypatch):
    """use_quack runs inside every compiled block of kernels="quack": its checks, the GPU's capability read as the
    real reader gives it (a constant result), trace without an error or a graph break."""
    from neobert.model import kernels

    monkeypatch.setattr(kernels, "cuda_capability", torch.compiler.assume_constant_result(lambda: (9, 0)))
    torch._dynamo.reset()
    takes = torch.compile(lambda x: x + kernels.quack_takes(torch.bfloat16, (768, 2048)), fullgraph=True,
                          backend="eager")
    assert takes(torch.zeros(1)).item() == 1
    monkeypatch.setattr(kernels, "cuda_capability", torch.compiler.assume_constant_result(lambda: (7, 5)))
    torch._dynamo.reset()
    assert takes(torch.zeros(1)).item() == 0
    torch._dynamo.reset()


def test_the_padded_decoder_under_autocast_pads_a_16_bit_copy_of_the_weight():
    """bf16-mixed training: float32 weights under autocast. The weight is cast before it is padded (a padded float32
    copy, then its cast, would move twice the bytes), and its gradient reaches the float32 weight."""
    weight = torch.randn(13, 16, requires_grad=True)
    x = torch.randn(4, 16)
    with LinearShapes() as shapes, torch.autocast("cpu", dtype=torch.bfloat16):
        out = modeling.padded_linear(x, weight, None, 8)
    assert shapes.weights == [(16, 16)] and out.dtype == torch.bfloat16 and out.shape == (4, 13)
    assert shapes.dtypes == [torch.bfloat16]  # padded after the cast: not a float32 padded copy
    out.float().sum().backward()
    assert weight.grad.dtype == torch.float32 and weight.grad.shape == (13, 16)
    torch.testing.assert_close(weight.grad, x.sum(0).expand(13, 16), rtol=2e-2, atol=2e-2)


def test_the_throughput_job_reports_why_neobert_liger_cannot_run_on_cpu():
    from neobert.instruments.encoders import ModelUnavailable, build_model

    assert "neobert-liger" in ThroughputConfig().models
    with pytest.raises(ModelUnavailable, match="CUDA|liger"):
        build_model("neobert-liger", torch.device("cpu"), torch.float32, "tiny")
    with pytest.raises(ModelUnavailable, match="kernels=quack runs on CUDA GPUs only|quack-kernels"):
        build_model("neobert-quack", torch.device("cpu"), torch.float32, "tiny")


def test_a_liger_kernel_older_than_the_fused_swiglu_and_losss_argmax_is_refused(monkeypatch):
    from neobert.model import kernels

    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: "0.7.3")
    assert "liger-kernel >= 0.8.2" in kernels.liger_missing_reason()
    # 0.8.0 and 0.8.1 have the fused loss's argmax but not the fused gate-up SwiGLU kernels=liger imports
    for too_old in ("0.8.0", "0.8.1", "0.8.2rc1"):
        monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: too_old)
        assert f"(installed: {too_old};" in kernels.liger_missing_reason()
    for recent in ("0.8.2", "0.8.5", "0.10.0"):
        monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: recent)
        assert kernels.liger_missing_reason() is None

    def no_metadata(name):
        raise kernels.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(kernels.importlib.metadata, "version", no_metadata)  # a source tree on the path
    assert kernels.liger_missing_reason() is None


LIGER_UNDER_THE_INTERPRETER = """
import torch, torch.nn.functional as F
from neobert.model.kernels import liger_linear_cross_entropy
torch.manual_seed(0)
rows, weight, bias = (torch.randn(37, 64, requires_grad=True), torch.randn(300, 64, requires_grad=True),
                      torch.randn(300, requires_grad=True))
targets = torch.randint(0, 300, (37,))
targets[3] = -100
loss, predictions = liger_linear_cross_entropy(rows, weight, bias, targets, -100)
(loss / 5).backward()  # a scale other than 1, as the mean over scored rows and gradient accumulation give
fused = [t.grad.clone() for t in (rows, weight, bias)]
for t in (rows, weight, bias):
    t.grad = None
logits = F.linear(rows, weight, bias)
reference = F.cross_entropy(logits, targets, reduction="sum")
(reference / 5).backward()
torch.testing.assert_close(loss, reference)
for got, t in zip(fused, (rows, weight, bias)):
    torch.testing.assert_close(got, t.grad)
assert predictions[3] == -1 and torch.equal(predictions[targets != -100], logits.argmax(-1)[targets != -100])

# Liger's fused SwiGLU as the MLP calls it (3-D activations in, Liger's 2-D rows inside; its backward writes over
# its input, as w12's output may be written). Its RMSNorm cannot run under the interpreter (a Triton bug).
from neobert.model.kernels import liger_swiglu
gate_up = torch.randn(2, 5, 16, requires_grad=True)
fused = liger_swiglu(gate_up * 1.0)
gate, up = gate_up.chunk(2, dim=-1)
reference = F.silu(gate) * up
torch.testing.assert_close(fused, reference)
fused.backward(torch.ones_like(fused))
fused_grad, gate_up.grad = gate_up.grad, None
reference.backward(torch.ones_like(reference))
torch.testing.assert_close(fused_grad, gate_up.grad)

# The model's head on it: the masked_index path with a filler entry, against the eager head (the encoder stays eager:
# only the head is told it runs on a GPU).
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM, modeling
from neobert.model import config as model_config_module
model_config_module.liger_missing_reason = lambda: None
modeling.fuses_mlm_loss = lambda fused, device_type, backward, compiling: fused and backward and not compiling
eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
liger = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", fused_mlm_loss=True))
liger.load_state_dict(eager.state_dict())
ids = torch.randint(5, 1000, (2, 12))
labels = torch.where(torch.rand(ids.shape) < 0.3, ids, torch.full_like(ids, -100))
labels[0, 0], labels[0, 1] = ids[0, 0], -100
index = torch.cat([(labels.reshape(-1) != -100).nonzero().squeeze(1), torch.tensor([1])])
outputs = []
for model in (eager, liger):
    out = model(ids, labels=labels, masked_index=index)
    out.loss.backward()
    outputs.append(out)
assert outputs[1].logits is None
torch.testing.assert_close(outputs[1].loss, outputs[0].loss)
for p_liger, p_eager in zip(liger.parameters(), eager.parameters()):
    torch.testing.assert_close(p_liger.grad, p_eager.grad, rtol=1e-4, atol=1e-6)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("liger_kernel") is None,
                    reason="Liger-Kernel under Triton's CPU interpreter needs the triton and liger-kernel packages")
def test_our_calls_of_ligers_kernels_under_tritons_interpreter():
    """The real Liger function on a CPU, its Triton kernels run by Triton's interpreter: our positional call (sum
    reduction, argmax output) gives PyTorch's loss, gradients and predictions, and so does the model's fused head;
    the fused SwiGLU gives PyTorch's output and gradient. Liger's RMSNorm cannot run there (the interpreter fails
    on it)."""
    result = subprocess.run([sys.executable, "-c", LIGER_UNDER_THE_INTERPRETER], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


needs_liger_on_cuda = pytest.mark.skipif(not torch.cuda.is_available() or liger_missing_reason() is not None,
                                         reason="Liger-Kernel's Triton kernels need a CUDA GPU and liger-kernel")


@needs_liger_on_cuda
@pytest.mark.parametrize("preset", ["tiny", "neobert"])
def test_liger_kernels_equal_the_eager_path_on_cuda(preset):
    torch.manual_seed(0)
    device = torch.device("cuda")
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset(preset, attention_backend="varlen")).to(device)
    liger = NeoBERTForMaskedLM(NeoBERTConfig.from_preset(preset, attention_backend="varlen", kernels="liger",
                                                         fused_mlm_loss=True))
    liger.load_state_dict(eager.state_dict())
    liger.to(device)
    ids = torch.randint(5, 30000, (4, 256), device=device)
    labels = torch.where(torch.rand(ids.shape, device=device) < 0.2, ids, torch.full_like(ids, -100))
    cu_seqlens = torch.tensor([0, 100, 356, 700, 1024], dtype=torch.int32, device=device)
    masked_index = (labels.reshape(-1) != -100).nonzero().squeeze(1)
    for kwargs in ({"masked_only": True}, {"masked_only": True, "cu_seqlens": cu_seqlens, "max_seqlen": 344},
                   {"masked_index": masked_index, "cu_seqlens": cu_seqlens, "max_seqlen": 344}):
        results = []
        for model in (eager, liger):  # bf16-mixed training: float32 weights, bf16 matmuls, float32 residual stream
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids, labels=labels, **kwargs)  # Liger: the fused linear cross-entropy, no logits
                with torch.no_grad():
                    logits = model(ids, labels=labels, **kwargs).logits.float()
            out.loss.backward()
            results.append((logits, out.predicted_ids(), out.loss, [p.grad.float() for p in model.parameters()]))
        (logits_e, predicted_e, loss_e, grads_e), (logits_l, predicted_l, loss_l, grads_l) = results
        assert out.logits is None
        torch.testing.assert_close(loss_l, loss_e, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(logits_l, logits_e, rtol=5e-2, atol=5e-2)
        # bf16 logits: an argmax may flip between two near-equal tokens, not more often than that
        assert (predicted_l == logits_e.argmax(-1)).float().mean() > 0.98
        for grad_l, grad_e in zip(grads_l, grads_e):
            scale = grad_e.abs().max().clamp(min=1e-6)  # bf16 matmuls: compare relative to each tensor's scale
            assert (grad_l - grad_e).abs().max() / scale < 5e-2
    with torch.inference_mode():  # bf16 weights: each bf16 path against the float32 model, Liger's no further off
        reference = eager.model(ids).last_hidden_state.float()
        errors = [(model.to(torch.bfloat16).model(ids).last_hidden_state.float() - reference).norm() / reference.norm()
                  for model in (eager, liger)]
    assert errors[1] <= 1.5 * errors[0] + 1e-3, f"bf16 error vs float32: liger {errors[1]:.4f}, eager {errors[0]:.4f}"



@needs_liger_on_cuda
def test_the_fused_loss_with_bf16_weights_on_cuda_is_no_further_from_float32_than_the_eager_head():
    """DeepSpeed's bf16 keeps bf16 weights: the fused loss's decoder gradient, summed over its chunks in float32, is
    as close to the float32 model's as the eager head's one bf16 matmul."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    reference = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("neobert", attention_backend="varlen")).to(device)
    ids = torch.randint(5, 30000, (8, 512), device=device)
    labels = torch.where(torch.rand(ids.shape, device=device) < 0.2, ids, torch.full_like(ids, -100))
    index = (labels.reshape(-1) != -100).nonzero().squeeze(1)
    gradients = {}
    for name, fused, dtype in (("float32", False, torch.float32), ("eager", False, torch.bfloat16),
                               ("liger", True, torch.bfloat16)):
        model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("neobert", attention_backend="varlen",
                                                             fused_mlm_loss=fused))
        model.load_state_dict(reference.state_dict())
        model.to(device=device, dtype=dtype)
        out = model(ids.reshape(-1), labels=labels.reshape(-1), masked_index=index,
                    cu_seqlens=torch.arange(0, 9 * 512, 512, dtype=torch.int32, device=device), max_seqlen=512)
        assert (out.logits is None) == fused
        out.loss.backward()
        gradients[name] = model.decoder.weight.grad.float()
    errors = {name: ((gradients[name] - gradients["float32"]).norm() / gradients["float32"].norm()).item()
              for name in ("eager", "liger")}
    assert errors["liger"] <= 1.5 * errors["eager"] + 1e-3, errors


def quack_missing_on_this_machine() -> str | None:
    """Why QuACK's MLP cannot run here: no CUDA GPU, the package, or an import that fails (its CuTe DSL)."""
    from neobert.model.kernels import quack_missing_reason

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if missing := quack_missing_reason():
        return missing
    try:
        from quack.mlp import mlp_func  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the skip says why
        return f"quack.mlp does not import: {type(err).__name__}: {err}"
    return None


@pytest.mark.skipif(quack_missing_on_this_machine() is not None, reason=str(quack_missing_on_this_machine()))
@pytest.mark.parametrize("compiled", [False, True])
def test_quacks_mlp_equals_the_eager_path_on_cuda(compiled, monkeypatch):
    """NeoBERT's MLP (768 -> 2 x 2,048 -> 768) and a whole model with kernels="quack", in bf16-mixed training
    (float32 weights under autocast) and in bf16 inference, eager and with each block compiled: QuACK's output and
    gradients against the eager path's, both against float32 (QuACK no further from it than eager bf16)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    config = NeoBERTConfig.from_preset("neobert")
    mlps = {kernels: layers.SwiGLU(config.hidden_size, config.ffn_hidden_size, kernels=kernels).to(device)
            for kernels in ("eager", "quack")}
    mlps["quack"].load_state_dict(mlps["eager"].state_dict())
    x = torch.randn(4096, config.hidden_size, device=device)
    grad = torch.randn_like(x)
    with torch.no_grad():
        expected = mlps["eager"](x)  # float32
    calls = []
    real_quack_mlp = layers.quack_swiglu_mlp
    monkeypatch.setattr(layers, "quack_swiglu_mlp", lambda *args: calls.append(1) or real_quack_mlp(*args))
    errors, grads = {}, {}
    for kernels, mlp in mlps.items():
        run = torch.compile(mlp) if compiled else mlp
        inputs = x.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = run(inputs)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        out.backward(grad)
        errors[kernels] = ((out.float() - expected).norm() / expected.norm()).item()
        grads[kernels] = (inputs.grad.float(), mlp.w12.weight.grad, mlp.w3.weight.grad)
    assert calls, "QuACK's MLP never ran"  # compiled: called at least where the graph was traced
    assert errors["quack"] <= 1.5 * errors["eager"] + 1e-3, errors
    for got, want in zip(grads["quack"], grads["eager"]):  # bf16 matmuls: relative to each tensor's scale
        assert got.dtype == want.dtype and (got - want).abs().max() / want.abs().max() < 5e-2
    torch.manual_seed(0)
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", attention_backend="varlen")).to(device)
    quack = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", attention_backend="varlen", kernels="quack"))
    quack.load_state_dict(eager.state_dict())
    quack.to(device)
    if compiled:
        quack.compile(scope="blocks")
    ids = torch.randint(5, 30000, (4, 256), device=device)
    calls.clear()
    with torch.inference_mode():
        hidden = [model.to(torch.bfloat16).model(ids).last_hidden_state.float() for model in (eager, quack)]
    assert calls, "QuACK's MLP never ran in the model"
    torch.testing.assert_close(hidden[1], hidden[0], rtol=5e-2, atol=5e-2)


@pytest.mark.gpu_image  # torch 2.11's Dynamo could not trace the first check; 2.13's can
def test_the_padded_decoder_runs_on_meta_tensors_and_compiles_without_a_graph_break():
    """A meta forward (shapes only, as the encoder allows) of the padded decoder: no autocast to ask about there; and
    the check that says so is one Dynamo traces (torch.amp.is_autocast_available broke the compiled head's graph)."""
    weight = torch.empty(13, 16, device="meta")
    out = modeling.padded_linear(torch.empty(4, 16, device="meta"), weight, torch.empty(13, device="meta"), 8)
    assert out.shape == (4, 13) and out.device.type == "meta"
    torch._dynamo.reset()
    compiled = torch.compile(modeling.padded_linear, fullgraph=True, backend="eager")
    x, weight = torch.randn(4, 16), torch.randn(13, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(x, weight, None, 8), modeling.padded_linear(x, weight, None, 8))
    torch._dynamo.reset()
