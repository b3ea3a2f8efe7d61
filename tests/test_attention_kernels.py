"""NeoBERTConfig.attention_kernel (neobert.model.attention): the packed batches' attention kernel, chosen or auto.

On CPU: the choice is validated, refused with the key's name where its package is missing, never written to
config.json; `auto` picks FlashAttention 3 only on a Hopper GPU in half precision without dropout; an explicit kernel
raises where it cannot take the dtype or the dropout, and runs padded_sdpa on CPU tensors. With stand-ins for
FlashAttention 3 (both of its return conventions), flash-attn and PyTorch's varlen_attn that compute attention per
document and record their arguments, the model calls the chosen one at every layer with int32 cu_seqlens and the
longest document, and gives the padded_sdpa outputs. The throughput job measures each kernel as a row of its own,
labelled with the kernel that ran, or says why not. On a CUDA GPU: each installed kernel's real outputs and
gradients against padded_sdpa (the test at the bottom; it skips elsewhere).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from neobert.config.throughput import ATTENTION_KERNEL_MODELS, MODEL_NAMES, ThroughputConfig
from neobert.instruments.preflight_kernels import training_attention_kernel
from neobert.model import NeoBERT, NeoBERTConfig, attention, flash_attn_4
from neobert.model.attention import ATTENTION_KERNELS, chosen_packed_kernel, packed_kernel
from neobert.model.config import ModelFieldError

CU_SEQLENS = [0, 5, 12, 24]  # three documents, the longest 12 tokens
EXPLICIT = [kernel for kernel in ATTENTION_KERNELS if kernel != "auto"]


@pytest.fixture
def installed(monkeypatch):
    """Every optional attention package "installed" (the flags the config and `auto` read)."""
    for flag in ("_HAS_FLASH_ATTN_4", "_HAS_FLASH_ATTN_3", "_HAS_FLASH_ATTN", "_HAS_XFORMERS"):
        monkeypatch.setattr(attention, flag, True)


# ---------------------------------------------------------------------------------------------- the choice
def test_attention_kernel_is_validated_naming_the_field():
    with pytest.raises(ModelFieldError, match=r"attention_kernel must be one of .*'fa3'") as err:
        NeoBERTConfig.from_preset("tiny", attention_kernel="fa3")
    assert err.value.field == "attention_kernel"


@pytest.mark.parametrize("kernel, flag, install", [
    ("flash_attn_4", "_HAS_FLASH_ATTN_4", "pip install flash-attn-4"),
    ("flash_attn_3", "_HAS_FLASH_ATTN_3", "cd hopper && python setup.py install"),
    ("flash_attn", "_HAS_FLASH_ATTN", "pip install flash-attn"),
    ("xformers", "_HAS_XFORMERS", "pip install xformers"),
])
def test_an_explicit_kernel_without_its_package_is_refused_with_the_install_command(monkeypatch, kernel, flag,
                                                                                    install):
    monkeypatch.setattr(attention, flag, False)
    with pytest.raises(ModelFieldError, match=f"attention_kernel '{kernel}' needs") as err:
        NeoBERTConfig.from_preset("tiny", attention_kernel=kernel)
    assert err.value.field == "attention_kernel" and install in err.value.reason
    monkeypatch.setattr(attention, flag, True)
    assert NeoBERTConfig.from_preset("tiny", attention_kernel=kernel).attention_kernel == kernel


def test_pytorchs_own_kernels_need_no_package(monkeypatch):
    for flag in ("_HAS_FLASH_ATTN_3", "_HAS_FLASH_ATTN", "_HAS_XFORMERS"):
        monkeypatch.setattr(attention, flag, False)
    for kernel in ("auto", "varlen_attn", "padded_sdpa"):
        assert NeoBERTConfig.from_preset("tiny", attention_kernel=kernel).attention_kernel == kernel


def test_pretraining_sets_it_with_model_overrides_and_names_the_key(monkeypatch):
    from neobert.data.tokenizer import load_tokenizer
    from neobert.errors import ConfigError
    from neobert.jobs.pretrain import build_model_config, load_pretrain_config

    config = load_pretrain_config("demo", ["model.overrides.attention_kernel=flash_attn_3"])
    tokenizer = load_tokenizer(config.data.tokenizer)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", False)
    with pytest.raises(ConfigError, match=r"model\.overrides\.attention_kernel.*FlashAttention 3"):
        build_model_config(config, tokenizer)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", True)
    assert build_model_config(config, tokenizer).attention_kernel == "flash_attn_3"
    bad = load_pretrain_config("demo", ["model.overrides.attention_kernel=fa3"])
    with pytest.raises(ConfigError, match=r"model\.overrides\.attention_kernel.*must be one of"):
        build_model_config(bad, tokenizer)


def test_the_choice_is_the_machines_not_written_to_config_json(tmp_path, installed):
    from neobert.model.hf import NeoBERTHFConfig

    model = NeoBERT(NeoBERTConfig.from_preset("tiny", attention_kernel="flash_attn_3"))
    model.save_pretrained(tmp_path / "ours")
    assert "attention_kernel" not in json.loads((tmp_path / "ours" / "config.json").read_text())
    assert NeoBERT.from_pretrained(tmp_path / "ours").config.attention_kernel == "auto"
    loaded = NeoBERT.from_pretrained(tmp_path / "ours", attention_kernel="varlen_attn")  # chosen at load
    assert loaded.config.attention_kernel == "varlen_attn"
    NeoBERTHFConfig(attention_kernel="flash_attn", kernels="eager").save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "attention_kernel" not in written and "kernels" not in written
    hf = NeoBERTHFConfig.from_pretrained(tmp_path / "hf", attention_kernel="flash_attn")
    assert hf.to_neobert_config().attention_kernel == "flash_attn"


# ---------------------------------------------------------------------------------------------- resolution
HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)


@pytest.mark.parametrize("capability, fa3, fa4, fa2, xformers, dtype, dropout, expected", [
    (HOPPER, True, True, True, True, torch.bfloat16, 0.0, "flash_attn_3"),
    (HOPPER, True, True, True, True, torch.float16, 0.0, "flash_attn_3"),
    (HOPPER, False, True, True, True, torch.bfloat16, 0.0, "flash_attn_4"),  # measured faster than FlashAttention 2
    (BLACKWELL, True, True, True, True, torch.bfloat16, 0.0, "flash_attn_4"),  # FA3 on Hopper (sm90) only
    (BLACKWELL, True, False, True, True, torch.bfloat16, 0.0, "flash_attn"),
    (AMPERE, True, True, True, True, torch.bfloat16, 0.0, "flash_attn"),  # FA4 on sm90/sm100 only
    (AMPERE, False, True, False, False, torch.bfloat16, 0.0, "varlen_attn"),
    ((12, 0), False, True, False, False, torch.bfloat16, 0.0, "varlen_attn"),  # consumer Blackwell is not sm100
    (HOPPER, True, True, True, True, torch.bfloat16, 0.1, "flash_attn"),  # FA3 and FA4 have no dropout
    (HOPPER, True, False, False, False, torch.bfloat16, 0.0, "flash_attn_3"),
    (HOPPER, False, False, False, False, torch.bfloat16, 0.0, "varlen_attn"),
    (HOPPER, True, True, False, False, torch.bfloat16, 0.1, "padded_sdpa"),
    (AMPERE, False, False, False, True, torch.bfloat16, 0.1, "xformers"),
    (HOPPER, True, True, True, True, torch.float32, 0.0, "padded_sdpa"),  # FlashAttention takes half precision only
])
def test_auto_takes_the_fastest_kernel_that_runs_the_step(monkeypatch, capability, fa3, fa4, fa2, xformers, dtype,
                                                          dropout, expected):
    monkeypatch.setattr(attention, "cuda_capability", lambda: capability)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", fa4)
    monkeypatch.setattr(attention, "_flash_attn_4_usable", lambda: True)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", fa3)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN", fa2)
    monkeypatch.setattr(attention, "_HAS_XFORMERS", xformers)
    assert packed_kernel("cuda", dtype, dropout) == expected
    assert chosen_packed_kernel("auto", "cuda", dtype, dropout) == expected
    assert chosen_packed_kernel("auto", "cpu", dtype, dropout) == "padded_sdpa"


@pytest.mark.parametrize("capability, head_dim, training, usable, expected", [
    (HOPPER, 64, True, True, "flash_attn_4"),
    (HOPPER, 64, False, True, "varlen_attn"),  # in training only: its forward alone is not measured against varlen_attn
    (HOPPER, 64, True, False, "varlen_attn"),  # installed but not importable: the next kernel
    (HOPPER, 192, True, True, "flash_attn_4"),  # Hopper takes 8-256
    (BLACKWELL, 192, True, True, "varlen_attn"),  # Blackwell 8-128 or 256
    (BLACKWELL, 256, True, True, "flash_attn_4"),
    (HOPPER, 20, True, True, "varlen_attn"),  # multiples of 8 only
    (HOPPER, 88, True, True, "flash_attn_4"),
    (HOPPER, None, True, True, "flash_attn_4"),  # the preflight, which knows no head size
])
def test_auto_takes_flash_attention_4_only_where_it_runs_the_step(monkeypatch, capability, head_dim, training,
                                                                  usable, expected):
    monkeypatch.setattr(attention, "cuda_capability", lambda: capability)
    monkeypatch.setattr(attention, "_flash_attn_4_usable", lambda: usable)
    for flag, value in (("_HAS_FLASH_ATTN_4", True), ("_HAS_FLASH_ATTN_3", False), ("_HAS_FLASH_ATTN", False)):
        monkeypatch.setattr(attention, flag, value)
    assert packed_kernel("cuda", torch.bfloat16, 0.0, head_dim, training) == expected
    assert chosen_packed_kernel("auto", "cuda", torch.bfloat16, 0.0, head_dim, training) == expected


def test_auto_runs_flash_attention_4_in_training_and_varlen_attn_under_no_grad(monkeypatch):
    """The model passes its head size and the grad mode: a training forward takes FA4, an evaluation one does not."""
    calls: list = []
    install_flash_attn_4(monkeypatch, calls, [])
    monkeypatch.setattr(attention, "varlen_attn", lambda q, *args: calls.append(("varlen_attn", q.shape[-1])) or q)
    monkeypatch.setattr(attention, "cuda_capability", lambda: HOPPER)
    monkeypatch.setattr(attention, "_flash_attn_4_usable", lambda: True)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", True)
    resolve = attention.chosen_packed_kernel
    monkeypatch.setattr(attention, "chosen_packed_kernel",
                        lambda choice, device_type, dtype, dropout_p, head_dim, training: calls.append(
                            ("head_dim", head_dim)) or resolve(choice, "cuda", torch.bfloat16, dropout_p, head_dim,
                                                               training))
    model = NeoBERT(NeoBERTConfig.from_preset("tiny", attention_backend="varlen"))
    ids, cu_seqlens = torch.randint(5, 1000, (24,)), torch.tensor(CU_SEQLENS)
    model(ids, cu_seqlens=cu_seqlens, max_seqlen=12)
    assert ("head_dim", model.config.head_dim) in calls and {c[0] for c in calls} == {"head_dim", "flash_attn_4"}
    calls.clear()
    with torch.no_grad():
        model(ids, cu_seqlens=cu_seqlens, max_seqlen=12)
    assert {c[0] for c in calls} == {"head_dim", "varlen_attn"}


@pytest.mark.parametrize("layout, warning", [
    ("real", None),
    ("renamed", r"lack \['_flash_attn_bwd\(cu_seqlens_q=\)'"),
    ("broken", r"does not import \(OSError: libcute_dsl_runtime.so"),
])
def test_flash_attention_4_is_usable_only_where_it_imports_with_our_keywords(monkeypatch, layout, warning):
    """Found is not enough for auto: FA4 must import (CuTe DSL's libraries load then) and its functions take the
    keywords our ops pass; else one warning, once per process, and auto takes the next kernel."""
    install_flash_attn_4(monkeypatch, [], [])
    if layout == "renamed":  # a later version renaming the private backward's keywords
        sys.modules["flash_attn.cute.interface"]._flash_attn_bwd = lambda q, k, v, out, dout, lse, *, cu_q=None: None
    if layout == "broken":  # CuTe DSL's libraries failing to load at import
        def load_failure(name):
            raise OSError("libcute_dsl_runtime.so: cannot open shared object file")

        sys.modules["flash_attn.cute"].__getattr__ = load_failure
        del sys.modules["flash_attn.cute"].flash_attn_varlen_func
    monkeypatch.setattr(attention, "_flash_attn_4_usable_cache", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = attention._flash_attn_4_usable(), attention._flash_attn_4_usable()
    assert first is second is (warning is None)
    messages = [str(w.message) for w in caught if "FlashAttention 4" in str(w.message)]
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1 and re.search(warning, messages[0]) and "running the next kernel" in messages[0]


# A "GPU" faked on a CUDA build of torch without a driver (PyPI's default wheel on a laptop): Dynamo then asks the
# CUDA runtime for the device's streams and properties, which fails (torch 2.11 tried). A CPU build or a GPU runs it.
@pytest.mark.skipif((torch.version.cuda or torch.version.hip) is not None and not torch.cuda.is_available(),
                    reason="a CUDA build of torch without a GPU cannot fake one to Dynamo")
def test_auto_reads_the_gpu_generation_without_a_graph_break(monkeypatch):
    """`auto` runs inside every compiled layer: the capability is a constant to Dynamo, not a break per layer. The
    device query here is one Dynamo cannot trace (as a real one may not be): tracing into it would break the graph."""
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", True)  # so that the choice reads the capability
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN", False)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", False)  # first on Hopper where installed
    install_flash_attn_4(monkeypatch, [], [])  # imported, and its signatures read, by the check Dynamo must not trace
    monkeypatch.setattr(attention, "_flash_attn_4_usable_cache", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", torch.compiler.disable(lambda: HOPPER))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: None)  # Dynamo keeps a "GPU's" random state
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: None)
    torch._dynamo.reset()
    step = torch.compile(lambda x: x + 1 if packed_kernel("cuda", torch.bfloat16, 0.0) == "flash_attn_4" else x * 2,
                         fullgraph=True, backend="eager")
    assert step(torch.full((2,), 3.0)).tolist() == [4.0, 4.0]
    torch._dynamo.reset()


@pytest.mark.parametrize("kernel", EXPLICIT)
def test_an_explicit_kernel_runs_as_asked_on_cuda_and_padded_sdpa_elsewhere(monkeypatch, kernel):
    monkeypatch.setattr(attention, "cuda_capability", lambda: AMPERE)  # no GPU generation check when asked for
    assert chosen_packed_kernel(kernel, "cuda", torch.bfloat16, 0.0) == kernel
    for device_type in ("cpu", "meta"):  # as Liger's kernels fall back to eager on CPU tensors
        assert chosen_packed_kernel(kernel, device_type, torch.float32, 0.1) == "padded_sdpa"


@pytest.mark.parametrize("kernel", ["flash_attn_4", "flash_attn_3", "flash_attn", "varlen_attn"])
def test_flashattention_kernels_refuse_float32_naming_the_field(kernel):
    with pytest.raises(ValueError, match=f"NeoBERTConfig.attention_kernel='{kernel}' takes bfloat16 or float16"):
        chosen_packed_kernel(kernel, "cuda", torch.float32, 0.0)


@pytest.mark.parametrize("kernel", ["flash_attn_4", "flash_attn_3", "varlen_attn"])
def test_kernels_without_dropout_refuse_a_training_dropout_naming_the_field(kernel):
    with pytest.raises(ValueError, match=f"attention_kernel='{kernel}' has no attention dropout.*0.1"):
        chosen_packed_kernel(kernel, "cuda", torch.bfloat16, 0.1)


def test_kernels_with_dropout_or_float32_take_them():
    assert chosen_packed_kernel("flash_attn", "cuda", torch.bfloat16, 0.1) == "flash_attn"
    assert chosen_packed_kernel("xformers", "cuda", torch.float32, 0.1) == "xformers"
    assert chosen_packed_kernel("padded_sdpa", "cuda", torch.float32, 0.1) == "padded_sdpa"


def test_the_preflight_words_follow_the_choice_and_refuse_what_cannot_run(monkeypatch):
    # none of the optional kernels to begin with, whatever this machine has (the GPU image has FA4)
    for flag in ("_HAS_FLASH_ATTN", "_HAS_FLASH_ATTN_3", "_HAS_FLASH_ATTN_4"):
        monkeypatch.setattr(attention, flag, False)
    monkeypatch.setattr(attention, "_flash_attn_4_usable", lambda: True)
    assert "PyTorch's varlen_attn" in training_attention_kernel("best_fit", "varlen", "cuda")
    words = training_attention_kernel("best_fit", "varlen", "cuda", kernel="flash_attn_3")
    assert "FlashAttention 3" in words and "(attention_kernel=flash_attn_3)" in words
    words = training_attention_kernel("none", "sdpa", "cuda", unpad=False, kernel="flash_attn_3")
    assert "SDPA with a key-padding mask" in words and "applies to batches with cu_seqlens only" in words
    with pytest.raises(ValueError, match="attention_kernel='varlen_attn' has no attention dropout"):
        training_attention_kernel("best_fit", "varlen", "cuda", dropout=0.1, kernel="varlen_attn")
    # auto looks at the GPU it runs on: a preflight without one says what a Hopper GPU would run
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", True)
    monkeypatch.setattr(attention, "cuda_capability", lambda: (0, 0))
    assert "FlashAttention 4's instead on a Hopper or Blackwell GPU" in training_attention_kernel("best_fit", "varlen",
                                                                                                   "cuda")
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", True)
    words = training_attention_kernel("best_fit", "varlen", "cuda")
    assert "FlashAttention 3's instead on a Hopper GPU" in words and "FlashAttention 4's on a Blackwell GPU" in words
    monkeypatch.setattr(attention, "cuda_capability", lambda: BLACKWELL)
    words = training_attention_kernel("best_fit", "varlen", "cuda")
    assert "FlashAttention 4's flash_attn_varlen_func" in words and "FlashAttention 3's instead" in words
    monkeypatch.setattr(attention, "cuda_capability", lambda: HOPPER)
    assert training_attention_kernel("best_fit", "varlen", "cuda").endswith(
        "FlashAttention 3's flash_attn_varlen_func (flash_attn_interface, Hopper)")
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", False)
    assert training_attention_kernel("best_fit", "varlen", "cuda").endswith(
        "FlashAttention 4's flash_attn_varlen_func (flash-attn-4, CuTe DSL; Hopper and Blackwell)")
    # on a Hopper or Blackwell GPU without it, the preflight says how to get it; not elsewhere
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", False)
    assert "FlashAttention 4 would run it faster: pip install -e '.[fa4]'" in training_attention_kernel(
        "best_fit", "varlen", "cuda")
    monkeypatch.setattr(attention, "cuda_capability", lambda: AMPERE)
    assert training_attention_kernel("best_fit", "varlen", "cuda").endswith(
        "PyTorch's varlen_attn (FlashAttention varlen)")
    # installed but unusable on a GPU it would run on: no "instead" (auto's own warning says why it was left out)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", True)
    monkeypatch.setattr(attention, "_flash_attn_4_usable", lambda: False)
    monkeypatch.setattr(attention, "cuda_capability", lambda: HOPPER)
    assert training_attention_kernel("best_fit", "varlen", "cuda").endswith(
        "PyTorch's varlen_attn (FlashAttention varlen)")


def test_the_preflight_refuses_a_kernel_the_run_cannot_use_naming_the_override():
    from neobert.instruments.preflight import Preflight, attention_section
    from neobert.jobs.pretrain import load_pretrain_config

    config = load_pretrain_config("demo", ["model.overrides.attention_kernel=varlen_attn", "data.packing=best_fit"])
    report = Preflight()
    attention_section(report, config, NeoBERTConfig.from_preset("tiny", attention_kernel="varlen_attn"), "32-true")
    [(key, why)] = report.refusals
    assert key == "model.overrides.attention_kernel" and "takes bfloat16 or float16" in why
    report = Preflight()
    attention_section(report, config, NeoBERTConfig.from_preset("tiny", attention_kernel="varlen_attn"), "bf16-mixed")
    assert not report.refusals and "PyTorch's varlen_attn" in "\n".join(report.lines)


def test_a_preflight_without_a_gpu_says_what_a_hopper_or_blackwell_target_would_run(monkeypatch):
    """`auto` decides on the GPU it runs on; a preflight for an H100 on a machine without one (and without FA4) names
    varlen_attn, and says that the H100 takes FlashAttention 4 where it is installed there. Not for a GPU FA4 was not
    written for, an explicit kernel, dropout, padded batches, float32, or where FA4 is installed here (the kernel's
    own line says so then)."""
    from neobert.instruments.preflight import Preflight, attention_section
    from neobert.instruments.preflight_kernels import gpu_capability
    from neobert.jobs.pretrain import load_pretrain_config

    assert [gpu_capability(name) for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA GH200 480GB",
                                              "NVIDIA B200", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S",
                                              "NVIDIA GeForce GTX 1080", "a GPU of the future")] == \
        [(9, 0), (9, 0), (9, 0), (10, 0), (8, 0), (8, 9), (6, 1), None]
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", False)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", False)
    monkeypatch.setattr(attention, "cuda_capability", lambda: (0, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def lines(gpu="NVIDIA H100 80GB HBM3", overrides=("data.packing=best_fit",), precision="bf16-mixed", **model):
        config = load_pretrain_config("demo", list(overrides))
        report = Preflight()
        attention_section(report, config, NeoBERTConfig.from_preset("tiny", **model), precision, gpu)
        return "\n".join(report.lines)

    note = "on the {}: FlashAttention 4 instead where flash-attn-4 is installed there, pip install -e '.[fa4]'"
    words = lines()
    assert "PyTorch's varlen_attn (FlashAttention varlen) (" + note.format("NVIDIA H100 80GB HBM3") in words
    assert note.format("NVIDIA B200") in lines("NVIDIA B200")
    wide_heads = {"num_attention_heads": 2, "hidden_size": 2 * 264}  # head size 264: past FA4's 256
    for other in (lines("NVIDIA A100-SXM4-80GB"), lines(attention_kernel="varlen_attn"), lines(dropout=0.1),
                  lines(overrides=("data.unpad=false",)), lines(precision="32-true"), lines(**wide_heads)):
        assert "FlashAttention 4 instead" not in other
    # installed and usable here: the model's plan for the H100 takes it, and the kernel's own line says so
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", True)
    monkeypatch.setattr(attention, "_flash_attn_4_usable", lambda: True)
    assert "with cu_seqlens: FlashAttention 4's flash_attn_varlen_func" in lines() and "instead" not in lines()
    assert "FlashAttention 4's instead on a Hopper" in lines("NVIDIA A100-SXM4-80GB")


# ---------------------------------------------------------------------------------------------- the wiring
def _attention_per_document(q, k, v, cu_seqlens):
    """What every varlen kernel computes: each document attends to itself only."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)).transpose(0, 1)
    return out


def _attention_and_lse_per_document(q, k, v, cu_seqlens):
    """FlashAttention 4's forward: the output and the logsumexp of the scores, float32 [heads, T] (empty documents
    have no rows)."""
    out, lse = torch.empty_like(q), q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k[start:end].float()) / q.shape[-1] ** 0.5
        lse[:, start:end] = scores.logsumexp(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[start:end].float()).to(q.dtype)
    return out, lse


def install_flash_attn_4(monkeypatch, calls: list, backward_calls: list) -> None:
    """flash-attn-4's modules (`flash_attn.cute`, `flash_attn.cute.interface`) as stand-ins with its signatures
    (4.0.0b36: keyword arguments after q, k, v, whose fourth positional is qv), computing what it computes and
    recording the calls: the forward in `calls` as the other stand-ins do, the backward in `backward_calls`. Also its
    batched `flash_attn_func` and the `_flash_attn_fwd` both call, which takes a tile (`calls` records those it is
    given, with whether the logsumexp was asked for), for scripts/bench/attention_ab.py's candidates."""

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, *, return_lse=False):
        assert qv is None
        out, lse = _attention_and_lse_per_document(q, k, v, cu_seqlens_q)
        calls.append(("flash_attn_4", dict(cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, max_q=max_seqlen_q,
                                           max_k=max_seqlen_k, args=(), kwargs={}, lse=lse)))
        return out, (lse if return_lse else None)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, *,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
        backward_calls.append(dict(lse=lse, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, max_q=max_seqlen_q,
                                   max_k=max_seqlen_k))
        # attention's gradient from the saved logsumexp (P = exp(S - lse)), as FlashAttention's backward computes it;
        # no autograd here: a custom op's backward runs below the autograd dispatch
        dq, dk, dv = (torch.zeros_like(tensor) for tensor in (q, k, v))
        scale = q.shape[-1] ** -0.5
        bounds = cu_seqlens_q.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            q_, k_, v_, out_, dout_ = (tensor[start:end].float() for tensor in (q, k, v, out, dout))
            p = (torch.einsum("qhd,khd->hqk", q_, k_) * scale - lse[:, start:end, None]).exp()
            dv[start:end] = torch.einsum("hqk,qhd->khd", p, dout_)
            dp = torch.einsum("qhd,khd->hqk", dout_, v_)
            ds = p * (dp - (dout_ * out_).sum(-1).transpose(0, 1)[..., None])
            dq[start:end] = torch.einsum("hqk,khd->qhd", ds, k_) * scale
            dk[start:end] = torch.einsum("hqk,qhd->khd", ds, q_) * scale
        return dq, dk, dv

    def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, *, tile_mn=None, return_lse=False):
        assert qv is None and seqused_q is None and seqused_k is None
        calls.append(("flash_attn_4 _flash_attn_fwd", dict(tile_mn=tile_mn, return_lse=return_lse)))
        if cu_seqlens_q is None:  # batched: [B, L, h, d]
            return flash_attn_func(q, k, v)[0], None, None, None, None
        out, lse = _attention_and_lse_per_document(q, k, v, cu_seqlens_q)
        return out, (lse if return_lse else None), None, None, None

    def flash_attn_func(q, k, v):
        batch, length = q.shape[:2]
        out, _ = _attention_and_lse_per_document(*(x.flatten(0, 1) for x in (q, k, v)),
                                                 attention.cu_seqlens_of_rows(batch, length))
        return out.view_as(q), None

    cute = types.ModuleType("flash_attn.cute")
    # as FA4's CuTe DSL calls, which Dynamo cannot trace: called from a compiled graph, a graph break
    cute.flash_attn_varlen_func = torch.compiler.disable(flash_attn_varlen_func)
    cute.flash_attn_func = torch.compiler.disable(flash_attn_func)
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_bwd = torch.compiler.disable(_flash_attn_bwd)
    interface._flash_attn_fwd = torch.compiler.disable(_flash_attn_fwd)
    cute.interface = interface
    for name, module in (("flash_attn.cute", cute), ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)


class StandInKernels:
    """FlashAttention 4 (`flash_attn.cute`), FlashAttention 3 (`flash_attn_interface`), flash-attn and PyTorch's
    varlen_attn replaced by the attention they compute, recording their arguments; the model's tensors pass for CUDA
    bf16 ones in the kernel's choice (the rest, the arithmetic included, runs as on CPU)."""

    def __init__(self, monkeypatch, fa3_returns_lse: bool = False):
        self.calls: list[tuple[str, dict]] = []
        calls = self.calls

        def recorder(name, returns_lse=False):
            def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *args, **kwargs):
                calls.append((name, dict(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, args=args, kwargs=kwargs)))
                out = _attention_per_document(q, k, v, cu_q)
                return (out, torch.zeros(q.shape[1], q.shape[0])) if returns_lse else out
            return varlen

        for module_name, name, returns_lse in (("flash_attn_interface", "flash_attn_3", fa3_returns_lse),
                                               ("flash_attn", "flash_attn", False)):
            module = types.ModuleType(module_name)
            module.flash_attn_varlen_func = recorder(name, returns_lse)
            monkeypatch.setitem(sys.modules, module_name, module)
        monkeypatch.setattr(attention, "varlen_attn", recorder("varlen_attn"))
        self.fa4_backward_calls: list[dict] = []
        install_flash_attn_4(monkeypatch, calls, self.fa4_backward_calls)
        for flag in ("_HAS_FLASH_ATTN_4", "_HAS_FLASH_ATTN_3", "_HAS_FLASH_ATTN"):
            monkeypatch.setattr(attention, flag, True)
        monkeypatch.setattr(attention, "cuda_capability", lambda: HOPPER)
        resolve = attention.chosen_packed_kernel
        monkeypatch.setattr(attention, "chosen_packed_kernel",
                            lambda choice, device_type, dtype, dropout_p, *head_dim_and_training: resolve(
                                choice, "cuda", torch.bfloat16, dropout_p, *head_dim_and_training))


def _packed_outputs(config: NeoBERTConfig, reference: NeoBERT, train: bool = False):
    model = NeoBERT(config)
    model.load_state_dict(reference.state_dict())
    model.train(train)
    ids = torch.randint(5, 1000, (CU_SEQLENS[-1],), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.tensor(CU_SEQLENS)  # int64 on purpose: the kernels get int32
    return model(ids, cu_seqlens=cu_seqlens, max_seqlen=12).last_hidden_state


@pytest.mark.parametrize("choice, called, fa3_returns_lse", [
    ("flash_attn_4", "flash_attn_4", False),
    ("flash_attn_3", "flash_attn_3", False),  # FlashAttention 3 returning out alone (later releases)
    ("flash_attn_3", "flash_attn_3", True),  # and (out, softmax_lse) (early releases)
    ("auto", "flash_attn_3", True),  # auto on a Hopper GPU with FlashAttention 3 installed
    ("flash_attn", "flash_attn", False),
    ("varlen_attn", "varlen_attn", False),
])
def test_the_chosen_kernel_runs_every_layer_with_int32_cu_seqlens_and_equals_padded_sdpa(monkeypatch, choice,
                                                                                         called, fa3_returns_lse):
    torch.manual_seed(0)
    reference = NeoBERT(NeoBERTConfig.from_preset("tiny"))
    expected = _packed_outputs(NeoBERTConfig.from_preset("tiny"), reference)  # CPU: padded_sdpa
    kernels = StandInKernels(monkeypatch, fa3_returns_lse)
    out = _packed_outputs(NeoBERTConfig.from_preset("tiny", attention_kernel=choice), reference)
    assert [name for name, _ in kernels.calls] == [called] * reference.config.num_hidden_layers
    for _, call in kernels.calls:
        assert call["cu_q"].dtype == torch.int32 and call["cu_q"].tolist() == CU_SEQLENS
        assert call["cu_k"] is call["cu_q"] and call["max_q"] == call["max_k"] == 12
        if called == "flash_attn_3":  # no dropout argument (it has none), nothing beyond the varlen arguments
            assert call["args"] == () and call["kwargs"] == {}
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _packed_training_step(config: NeoBERTConfig, reference: NeoBERT, compile_backend: str | None = None):
    """A float32 forward + backward of the tiny model over the packed documents: (last hidden state, gradients)."""
    model = NeoBERT(config)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(5, 1000, (CU_SEQLENS[-1],), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)

    def forward(ids, cu_seqlens):
        hidden = model(ids, cu_seqlens=cu_seqlens, max_seqlen=12).last_hidden_state
        return hidden, hidden.square().mean()

    if compile_backend is not None:  # one graph or an error: a graph break in any layer fails the test
        forward = torch.compile(forward, backend=compile_backend, fullgraph=True)
    hidden, loss = forward(ids, cu_seqlens)
    loss.backward()  # compiled: AOTAutograd's backward graph
    return hidden.detach(), {name: parameter.grad for name, parameter in model.named_parameters()}


def test_flash_attn_4_gradients_come_from_its_backward_with_the_forwards_logsumexp(monkeypatch):
    """FlashAttention 4 runs as two custom ops: its backward (stand-in: autograd over the per-document attention) gets
    the forward's logsumexp, the documents and the longest, once per layer, and the model's gradients equal
    padded_sdpa's."""
    torch.manual_seed(0)
    reference = NeoBERT(NeoBERTConfig.from_preset("tiny"))
    hidden_ref, grads_ref = _packed_training_step(NeoBERTConfig.from_preset("tiny"), reference)  # CPU: padded_sdpa
    kernels = StandInKernels(monkeypatch)
    hidden, grads = _packed_training_step(NeoBERTConfig.from_preset("tiny", attention_kernel="flash_attn_4"), reference)
    layers = reference.config.num_hidden_layers
    assert [name for name, _ in kernels.calls] == ["flash_attn_4"] * layers
    assert len(kernels.fa4_backward_calls) == layers
    forward_lses = [call["lse"] for _, call in kernels.calls]
    for backward in kernels.fa4_backward_calls:  # layers run backwards in reverse order
        assert backward["lse"].data_ptr() == forward_lses.pop().data_ptr()  # the saved tensor itself
        assert backward["cu_q"].tolist() == CU_SEQLENS and backward["max_q"] == backward["max_k"] == 12
    torch.testing.assert_close(hidden, hidden_ref, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_flash_attn_4_ops_pass_torch_library_opcheck(monkeypatch):
    """The ops' schema, fake (shapes for the compiler), autograd registration and AOT dispatch, checked by PyTorch on
    CPU tensors through the stand-in."""
    StandInKernels(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(CU_SEQLENS[-1], 2, 8, generator=generator, requires_grad=True) for _ in range(3))
    cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    torch.library.opcheck(flash_attn_4.flash_attn_4_varlen, (q, k, v, cu_seqlens, 12))
    out, lse = (tensor.detach() for tensor in flash_attn_4.flash_attn_4_varlen(q, k, v, cu_seqlens, 12))
    # the backward has no backward of its own (no double backward, as in FlashAttention): inputs without gradients
    torch.library.opcheck(flash_attn_4.flash_attn_4_varlen_backward,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu_seqlens, 12))


def test_flash_attn_4_compiles_into_one_graph_with_the_model(monkeypatch):
    """Under torch.compile (fullgraph: any graph break fails) the model's forward and backward through FlashAttention
    4's ops, Dynamo and AOTAutograd included (backend aot_eager: the graphs run eagerly), give padded_sdpa's
    outputs and gradients."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    reference = NeoBERT(NeoBERTConfig.from_preset("tiny"))
    hidden_ref, grads_ref = _packed_training_step(NeoBERTConfig.from_preset("tiny"), reference)
    kernels = StandInKernels(monkeypatch)
    hidden, grads = _packed_training_step(NeoBERTConfig.from_preset("tiny", attention_kernel="flash_attn_4"), reference,
                                          compile_backend="aot_eager")
    assert len(kernels.fa4_backward_calls) == reference.config.num_hidden_layers
    torch.testing.assert_close(hidden, hidden_ref, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_flash_attn_4s_compiled_graphs_are_ones_cuda_graphs_can_take(monkeypatch):
    """Under compile_mode=reduce-overhead Inductor records a graph as CUDA graphs only where no node of it is one they
    cannot take (a read of a device value, an op tagged cudagraph_unsafe, a CPU tensor) and its inputs are tensors or
    sizes: the model's forward and backward graphs through FlashAttention 4's ops pass Inductor's own check, so the
    rows of run_checks' graph steps are recorded, not skipped (which cuda_graphs_or_error would make an error)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    graphs = []

    def keep(kind):
        def compiler(graph_module, example_inputs):
            graphs.append((kind, graph_module, example_inputs))
            return make_boxed_func(graph_module.forward)
        return compiler

    torch._dynamo.reset()
    reference = NeoBERT(NeoBERTConfig.from_preset("tiny"))
    StandInKernels(monkeypatch)
    _packed_training_step(NeoBERTConfig.from_preset("tiny", attention_kernel="flash_attn_4"), reference,
                          compile_backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")))
    assert [kind for kind, _, _ in graphs] == ["forward", "backward"]
    for kind, graph_module, inputs in graphs:
        targets = [str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"]
        assert sum("flash_attn_4_varlen" in target for target in targets) == reference.config.num_hidden_layers, kind
        assert get_first_incompatible_cudagraph_node(graph_module) is None, kind
        assert all(isinstance(value, (torch.Tensor, torch.SymInt)) for value in inputs), kind


FLASH_ATTN_2 = ["flash_attn/__init__.py", "flash_attn/cute/__init__.py", "flash_attn/cute/interface.py"]  # 2.8.3's
FLASH_ATTN_4 = ["flash_attn/cute/__init__.py", "flash_attn/cute/interface.py",
                "flash_attn_4-4.0.0b36.dist-info/METADATA"]


@pytest.mark.parametrize("folders, expected", [
    ([[]], (False, False)),
    ([FLASH_ATTN_2], (True, False)),  # flash-attn 2 ships an early cute/ folder: not FlashAttention 4
    ([FLASH_ATTN_4], (False, True)),  # flash-attn-4 alone: flash_attn is a namespace package
    ([FLASH_ATTN_2 + FLASH_ATTN_4], (True, True)),  # both, one folder
    ([FLASH_ATTN_2, FLASH_ATTN_4], (True, False)),  # flash-attn 2 first on sys.path: its package hides FA4's folder
    ([FLASH_ATTN_4, FLASH_ATTN_2], (True, False)),  # a regular package wins over a namespace portion wherever it is
])
def test_flash_attn_packages_tells_flash_attn_2_from_flash_attn_4(monkeypatch, tmp_path, folders, expected):
    path = []
    for index, files in enumerate(folders):  # each a folder on sys.path (a site-packages) holding these files
        for name in files:
            (tmp_path / str(index) / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / str(index) / name).write_text("Metadata-Version: 2.1\nName: flash-attn-4\nVersion: 4.0.0b36\n"
                                                      if name.endswith("METADATA") else "")
        path.append(str(tmp_path / str(index)))
    monkeypatch.setattr(sys, "path", path)  # these files only: no real install is seen
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    importlib.invalidate_caches()
    assert attention.flash_attn_packages() == expected


def test_flash_attn_gets_the_training_dropout_and_none_in_eval(monkeypatch):
    reference = NeoBERT(NeoBERTConfig.from_preset("tiny"))
    kernels = StandInKernels(monkeypatch)
    config = NeoBERTConfig.from_preset("tiny", attention_kernel="flash_attn", dropout=0.1)
    _packed_outputs(config, reference, train=True)
    _packed_outputs(config, reference, train=False)
    layers = config.num_hidden_layers
    assert [call["kwargs"]["dropout_p"] for _, call in kernels.calls] == [0.1] * layers + [0.0] * layers


def test_a_kernel_without_dropout_raises_in_a_training_step_with_dropout(monkeypatch):
    reference = NeoBERT(NeoBERTConfig.from_preset("tiny"))
    StandInKernels(monkeypatch)
    config = NeoBERTConfig.from_preset("tiny", attention_kernel="varlen_attn", dropout=0.1)
    _packed_outputs(config, reference, train=False)  # no dropout in evaluation: runs
    with pytest.raises(ValueError, match="attention_kernel='varlen_attn' has no attention dropout"):
        _packed_outputs(config, reference, train=True)


@pytest.mark.parametrize("kernel", EXPLICIT)
def test_on_cpu_every_choice_runs_padded_sdpa_and_calls_no_kernel_package(monkeypatch, installed, kernel):
    def never(*args, **kwargs):
        raise AssertionError("a GPU kernel was called on CPU tensors")

    for module_name in ("flash_attn_interface", "flash_attn", "flash_attn.cute"):
        module = types.ModuleType(module_name)
        module.flash_attn_varlen_func = never
        monkeypatch.setitem(sys.modules, module_name, module)
    monkeypatch.setattr(attention, "varlen_attn", never)
    monkeypatch.setitem(sys.modules, "xformers", None)  # importing it would fail
    torch.manual_seed(0)
    reference = NeoBERT(NeoBERTConfig.from_preset("tiny"))
    expected = _packed_outputs(NeoBERTConfig.from_preset("tiny"), reference)
    out = _packed_outputs(NeoBERTConfig.from_preset("tiny", attention_kernel=kernel), reference, train=True)
    torch.testing.assert_close(out, expected)  # dropout 0: train and eval agree


# ---------------------------------------------------------------------------------------------- throughput
def test_every_explicit_kernel_has_a_throughput_model_and_the_default_run_is_unchanged():
    assert ATTENTION_KERNEL_MODELS == tuple(f"neobert-{kernel}" for kernel in EXPLICIT)
    assert set(ATTENTION_KERNEL_MODELS) <= set(MODEL_NAMES)
    assert not set(ATTENTION_KERNEL_MODELS) & set(ThroughputConfig().models)
    ThroughputConfig(models=["neobert", *ATTENTION_KERNEL_MODELS]).validate()


def test_a_kernel_that_cannot_run_here_is_a_row_saying_why(monkeypatch):
    from neobert.instruments.encoders import ModelUnavailable, build_model

    cpu = torch.device("cpu")
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", False)
    with pytest.raises(ModelUnavailable, match="needs FlashAttention 3"):
        build_model("neobert-flash_attn_3", cpu, torch.float32, "tiny")
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", True)
    with pytest.raises(ModelUnavailable, match="attention_kernel=flash_attn_3 runs on CUDA GPUs only"):
        build_model("neobert-flash_attn_3", cpu, torch.float32, "tiny")
    # on a GPU, the step's dtype and dropout decide (refused before the model is built: no GPU needed here)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN", True)
    with pytest.raises(ModelUnavailable, match="takes bfloat16 or float16"):
        build_model("neobert-flash_attn", torch.device("cuda"), torch.float32, "tiny")
    with pytest.raises(ModelUnavailable, match="has no attention dropout"):
        build_model("neobert-varlen_attn", torch.device("cuda"), torch.float32, "bert-base",
                    compute_dtype=torch.bfloat16, training=True)  # bert-base's dropout 0.1


def test_measured_rows_are_labelled_with_the_kernel_that_ran_and_exercise_it(monkeypatch, tmp_path):
    from neobert.instruments import throughput as job
    from neobert.instruments.throughput_report import markdown_table

    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_3", False)
    padded_sdpa_calls = []
    by_padding = attention._attend_packed_by_padding
    monkeypatch.setattr(attention, "_attend_packed_by_padding",
                        lambda *args: padded_sdpa_calls.append(1) or by_padding(*args))
    config = ThroughputConfig(models=["neobert", "neobert-padded_sdpa", "neobert-flash_attn_3"], neobert_preset="tiny",
                              lengths=[16], layouts=["full", "padded", "unpadded"], batch_sizes=[2], repeats=1,
                              warmup=0, device="cpu", matmul_calls=1)
    rows = {(row.model, row.layout): row for row in job.run_throughput(config)}
    assert rows["neobert", "full"].note == "attention: sdpa (no mask)"
    assert rows["neobert", "padded"].note == "attention: sdpa (key-padding mask)"
    assert rows["neobert", "unpadded"].note == "attention: padded_sdpa"  # what auto picks on a CPU
    assert rows["neobert-padded_sdpa", "full"].note == "attention: padded_sdpa (rows as documents, cu_seqlens)"
    assert rows["neobert-padded_sdpa", "unpadded"].note == "attention: padded_sdpa"
    assert rows["neobert-padded_sdpa", "padded"].tokens_per_s is None  # it would time SDPA, not the kernel
    assert rows["neobert-padded_sdpa", "padded"].note.startswith("padded batches run SDPA")
    assert all(rows["neobert-padded_sdpa", layout].tokens_per_s > 0 for layout in ("full", "unpadded"))
    for layout in ("full", "padded", "unpadded"):
        assert rows["neobert-flash_attn_3", layout].tokens_per_s is None
        assert "needs FlashAttention 3" in rows["neobert-flash_attn_3", layout].note
    # the explicit kernel's full and unpadded steps went through it (2 layers, one timed step each), auto's unpadded
    assert len(padded_sdpa_calls) == 2 * (2 + 1)
    table = markdown_table(list(rows.values()))
    assert "| neobert-padded_sdpa |" in table and "neobert-flash_attn_3: not available" in table


# ---------------------------------------------------------------------------------------------- on a GPU
def _installed_kernels_on_cuda() -> list[str]:
    if not torch.cuda.is_available():
        return []
    major_minor = torch.cuda.get_device_capability()
    return [kernel for kernel in ("varlen_attn", "flash_attn", "flash_attn_3", "flash_attn_4", "xformers")
            if attention.attention_kernel_missing_reason(kernel) is None
            and (kernel != "flash_attn_3" or major_minor == (9, 0))
            and (kernel != "flash_attn_4" or major_minor[0] in (9, 10))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real attention kernels need a CUDA GPU")
@pytest.mark.parametrize("kernel", _installed_kernels_on_cuda() or ["varlen_attn"])
@pytest.mark.parametrize("head_dim", [16, 64])  # the tiny preset's, and NeoBERT's (a kernel's tiles follow it)
def test_each_installed_kernel_equals_padded_sdpa_on_cuda(kernel, head_dim):
    """The real kernels on a GPU, bf16, a packed batch of uneven documents (one empty, as a static batch's filler):
    the model's outputs against the padded_sdpa reference within bf16 tolerance, and every gradient as close to the
    float32 model's as padded_sdpa's own bf16 gradient is. Two bf16 paths cannot be compared with each other
    directly: on the H200 each was 5-11% (max error over max) from float32 on the small gradients, padded_sdpa's as
    much as the kernel's (docs/benchmarks.md, 2026-11-26)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    shape = dict(attention_backend="varlen", hidden_size=4 * head_dim, intermediate_size=12 * head_dim)  # 4 heads
    state = NeoBERT(NeoBERTConfig.from_preset("tiny", **shape)).state_dict()
    cu_seqlens = torch.tensor([0, 37, 37, 300, 512], dtype=torch.int32, device=device)
    ids = torch.randint(5, 30000, (512,), device=device)

    def run(chosen: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = NeoBERT(NeoBERTConfig.from_preset("tiny", attention_kernel=chosen, **shape))
        model.load_state_dict(state)
        model.to(device=device, dtype=dtype)
        hidden = model(ids, cu_seqlens=cu_seqlens, max_seqlen=263).last_hidden_state
        hidden.float().square().mean().backward()
        return hidden.detach().float(), [p.grad.float() for p in model.parameters()]

    (_, grads_float32), (hidden_ref, grads_ref), (hidden_chosen, grads_chosen) = (
        run("padded_sdpa", torch.float32), run("padded_sdpa", torch.bfloat16), run(kernel, torch.bfloat16))
    torch.testing.assert_close(hidden_chosen, hidden_ref, rtol=3e-2, atol=3e-2)
    for grad_chosen, grad_ref, grad_float32 in zip(grads_chosen, grads_ref, grads_float32):
        error_chosen, error_ref = ((grad - grad_float32).norm() / grad_float32.norm()
                                   for grad in (grad_chosen, grad_ref))
        assert error_chosen <= 1.5 * error_ref + 1e-3, f"{kernel} {error_chosen:.4f} vs padded_sdpa {error_ref:.4f}"


def test_cudnns_masked_backward_nan_is_guarded_exactly_where_its_conditions_hold():
    """pytorch#196678's conditions but the data's: a CUDA GPU of compute capability 9 (Hopper), torch 2.11 or later, a
    mask, keys 64 more than a multiple of 128, and a backward to follow. Each condition alone lifts the guard."""
    exposed = attention.cudnn_masked_backward_exposed
    hopper = dict(device_type="cuda", length=192, masked=True, needs_grad=True, capability=lambda: (9, 0),
                  torch_version="2.11.0+cu130")
    assert exposed(**hopper) and exposed(**{**hopper, "length": 64}) and exposed(**{**hopper, "length": 1088})
    for version in ("2.13.0", "2.11.0a0+5228986c39.nv26.01", "2.11.0rc1", "2.12.0.dev20260901"):  # NGC, pre-releases
        assert exposed(**{**hopper, "torch_version": version}), version
    for change in ({"device_type": "cpu"}, {"length": 256}, {"length": 200}, {"masked": False},
                   {"needs_grad": False}, {"capability": lambda: (8, 0)}, {"capability": lambda: (10, 0)},
                   {"torch_version": "2.10.1+cu128"}, {"torch_version": "1.13.1"}):
        assert not exposed(**{**hopper, **change}), change
    # the GPU is asked last: never on a CPU, nor where another condition already fails
    assert not exposed(**{**hopper, "device_type": "cpu", "capability": lambda: pytest.fail("read the GPU")})
    assert not exposed(**{**hopper, "length": 256, "capability": lambda: pytest.fail("read the GPU")})


def test_the_guard_leaves_out_cudnn_alone_and_keeps_the_backends_the_caller_left_on(monkeypatch):
    """Where the conditions hold (stood in for here: a CPU's tensors, as if on a Hopper GPU), SDPA runs with cuDNN's
    kernel disabled for that call only, in the padded path and in padded_sdpa's grid, with the same result; elsewhere
    (the control length, no backward, no mask) as PyTorch chooses. A backend the caller disabled stays disabled."""
    real = attention.cudnn_masked_backward_exposed
    seen = []
    monkeypatch.setattr(attention, "cudnn_masked_backward_exposed",
                        lambda device_type, length, masked, needs_grad, capability:
                        real("cuda", length, masked, needs_grad, lambda: (9, 0)))
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)

    def run(length: int, grad: bool = True, padded: bool = True, kernel_layout: str = "padded") -> torch.Tensor:
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, length, 2, 16, requires_grad=grad) for _ in range(3))
        mask = torch.ones(2, length, dtype=torch.long)
        if padded:
            mask[1, length - 40:] = 0
        if kernel_layout == "padded":
            return attention.attend(q, k, v, attention.AttentionLayout.padded(mask))
        lengths = mask.sum(1)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        flat = [t.reshape(-1, 2, 16)[mask.reshape(-1).bool()] for t in (q, k, v)]
        return attention.attend(*flat, attention.AttentionLayout.from_cu_seqlens(cu, length), kernel="padded_sdpa")

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    guarded = run(192)
    assert seen.pop() == (False, True)
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()) == before
    run(192, kernel_layout="packed")  # padded_sdpa's grid: the longest document's length, with its mask
    assert seen.pop() == (False, True)
    with torch.no_grad():
        unguarded = run(192, grad=False)
    torch.testing.assert_close(guarded.detach(), unguarded)
    run(256)
    run(192, padded=False)  # no padding: no mask
    assert seen[-3:] == [before] * 3
    seen.clear()
    torch.backends.cuda.enable_mem_efficient_sdp(False)  # the caller's choice stays
    try:
        run(192)
        assert seen.pop() == (False, False)
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(before[1])


def test_the_preflight_words_follow_the_head_size_auto_takes_fa4_at(monkeypatch):
    """FlashAttention 4's tiles follow the head size: on Blackwell it takes 8-128 or 256, so `auto` runs varlen_attn
    for a head of 192, and the preflight, given the model's head size, says so."""
    for flag, value in (("_HAS_FLASH_ATTN", False), ("_HAS_FLASH_ATTN_3", False), ("_HAS_FLASH_ATTN_4", True)):
        monkeypatch.setattr(attention, flag, value)
    monkeypatch.setattr(attention, "_flash_attn_4_usable", lambda: True)
    monkeypatch.setattr(attention, "cuda_capability", lambda: (10, 0))
    fa4, varlen = "cu_seqlens: FlashAttention 4's flash_attn_varlen_func", "cu_seqlens: PyTorch's varlen_attn"
    assert fa4 in training_attention_kernel("best_fit", "varlen", "cuda", head_dim=64)
    assert varlen in training_attention_kernel("best_fit", "varlen", "cuda", head_dim=192)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's SDPA kernels need a CUDA GPU")
@pytest.mark.parametrize("length", [192, 256])
def test_padded_sdpa_gradients_stay_finite_where_cudnns_masked_backward_fails_on_cuda(length):
    """The model's padded path (SDPA with a key-padding mask, PyTorch's choice of kernel) at the conditions of
    pytorch/pytorch#196678: since torch 2.11, on H100/H200, cuDNN's SDPA backward returns NaN in q's gradient when a
    mask is given, the length is 64 more than a multiple of 128 (192 here; 256 is the control) and a query row's
    logsumexp is below ln(FLT_MAX) = -88.7 (forced here as in that issue's repro: every logit near -120). Fine-tuning
    batches are padded to a multiple of 8, so one in 16 has such a length. The guard (`masked_sdpa`: cuDNN left out
    of those calls) must keep every gradient finite. The same call with cuDNN forced, unguarded, is the control: its
    count of non-finite gradients is printed (run_checks' -rA shows it), so that a pass says whether the bug was
    there to guard against on this GPU and torch; it ran on no GPU yet."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    heads, head_dim = 2, 64
    base = torch.randn(2, length, heads, head_dim, device="cuda", dtype=torch.bfloat16) * 0.1
    mask = torch.ones(2, length, dtype=torch.long, device="cuda")
    mask[1, length - 40:] = 0
    layout = attention.AttentionLayout.padded(mask)
    upstream = torch.randn_like(base)

    def gradients(call) -> list[torch.Tensor]:
        q, k, v = base.clone(), torch.randn_like(base) * 0.1, torch.randn_like(base)
        q[..., 0], k[..., 0] = 1.0, -120 * head_dim ** 0.5  # every logit about -120: each row's logsumexp < -88.7
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = call(q, k, v)
        out.backward(upstream)
        return [out, q.grad, k.grad, v.grad]

    torch.manual_seed(1)
    guarded = gradients(lambda q, k, v: attention.attend(q, k, v, layout))
    torch.manual_seed(1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            control = gradients(lambda q, k, v: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=layout.key_padding_mask
            ).transpose(1, 2))
            bad = int((~torch.isfinite(control[1])).sum())
            guard = attention.cudnn_masked_backward_exposed("cuda", length, True, True,
                                                            torch.cuda.get_device_capability)
            print(f"control, cuDNN forced at length {length}: {bad} non-finite values in q's gradient "
                  f"({'the bug reproduced' if bad else 'no bug here'}; the guard {'on' if guard else 'off'})")
        except RuntimeError as err:  # cuDNN's kernel not available for these inputs on this GPU
            print(f"control, cuDNN forced at length {length}: not run ({err})")
    for name, tensor in zip(("output", "q", "k", "v"), guarded):
        assert torch.isfinite(tensor).all(), f"{name}: {int((~torch.isfinite(tensor)).sum())} values not finite"
