"""The bf16/fp16 eager path of the model: no dtype round trips per layer, outputs bounded by float32's.

Where matmuls are cheap (bf16 on AMX/avx512_bf16 CPUs, any GPU) the copies of activations to float32 and back in
the norms and RoPE cost more than they should. The number of dtype copies of one forward does not depend
on the machine, so it is what these tests hold; the speed is in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from neobert.instruments.timing import dtype_conversions
from neobert.model import NeoBERT, NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model.layers import RMSNorm, rms_norm_in_dtype
from neobert.model.rope import RotaryTables, apply_rope, rope_tables


def count_dtype_copies(model, *inputs):
    return dtype_conversions(lambda: model(*inputs))


def tiny(layers: int, **overrides) -> NeoBERTConfig:
    return NeoBERTConfig.from_preset("tiny", vocab_size=1000, max_length=128, num_hidden_layers=layers, **overrides)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_bf16_forward_copies_no_activation_to_another_dtype(packed):
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    inputs = (ids.reshape(-1), None, None, torch.tensor([0, 30, 64])) if packed else (ids, mask)
    copied = {layers: count_dtype_copies(NeoBERT(tiny(layers)).to(torch.bfloat16).eval(), *inputs).elements
              for layers in (2, 6)}
    per_layer = (copied[6] - copied[2]) / 4
    # What a layer may convert: per-token scalars (each norm's mean square, 4 conversions of [tokens, 1]). The path
    # that copied every norm's and RoPE's input to float32 and back converted 6 activations per layer, 2 of them
    # twice the hidden size: 4 x 2 x tokens x hidden + 2 x 2 x tokens x 2 x hidden (the `neobert` preset, batch
    # 8 x 512: 345 conversions of 711M elements before, 1.5M now; docs/benchmarks.md).
    assert per_layer <= 2 * 4 * ids.numel()
    # Outside the layers: the RoPE tables (float32, built once per forward, cos and sin for q and k) cast once, the
    # positions, the final norm's scalars.
    head_dim = tiny(2).hidden_size // tiny(2).num_attention_heads
    assert copied[2] - 2 * per_layer <= 2 * ids.numel() * 2 * head_dim + 8 * ids.numel()


def test_a_float32_forward_makes_no_dtype_copy_of_an_activation():
    ids = torch.randint(5, 1000, (2, 32))
    copies = count_dtype_copies(NeoBERT(tiny(4)).eval(), ids)
    assert copies.elements <= 2 * ids.numel()  # the positions, int -> float32, and a few scalars; no activation


def test_bf16_outputs_stay_within_a_bound_of_float32_outputs_of_the_same_weights():
    torch.manual_seed(0)
    config = tiny(4)
    reference = NeoBERTForMaskedLM(config).eval()
    half = NeoBERTForMaskedLM(config).eval()
    half.load_state_dict(reference.state_dict())
    half.to(torch.bfloat16)
    ids = torch.randint(5, 1000, (4, 64))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    keep = mask.bool()
    with torch.inference_mode():
        expected = reference(ids, mask).last_hidden_state[keep]
        got = half(ids, mask).last_hidden_state.float()[keep]
    relative = (got - expected).norm() / expected.norm()
    # Measured: 0.0060, against 0.0056 for the path that upcast every norm and RoPE to float32 (bf16 keeps 8 bits).
    assert relative < 0.01
    assert F.cosine_similarity(got, expected, dim=-1).min() > 0.999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_in_half_precision_equals_float32_up_to_rounding(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 48) * 4
    expected = norm(x)
    assert torch.equal(expected, F.rms_norm(x, (48,), norm.weight, 1e-5))  # float32: nn.RMSNorm's own path
    half = RMSNorm(48, eps=1e-5).to(dtype)
    half.load_state_dict(norm.state_dict())
    with torch.inference_mode():
        got = half(x.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_rmsnorm_in_bf16_trains():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    direction = torch.randn(4, 16)  # not the sum of squares: an RMS-normalised vector's is constant, its gradient 0
    (norm(x).float() * direction).sum().backward()
    expected_x = x.detach().float().requires_grad_()
    reference = RMSNorm(16, eps=1e-5)
    (F.rms_norm(expected_x, (16,), reference.weight, 1e-5) * direction).sum().backward()
    torch.testing.assert_close(x.grad.float(), expected_x.grad, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(norm.weight.grad.float(), reference.weight.grad, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's fused RMSNorm kernel runs on a CUDA GPU")
@pytest.mark.parametrize("autocast", [False, True], ids=["no-autocast", "autocast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_in_half_precision_on_cuda_is_pytorchs_fused_kernel(dtype, autocast):
    """On CUDA the norm is aten::_fused_rms_norm (one kernel each way), not the CPU's chain of ops
    (`rms_norm_in_dtype`), in x's dtype also under autocast (FSDP2's bf16 parameters: no float32 copy of x in, no
    float32 out); its output and gradients are float32's up to rounding, and no further from them than the chain's
    (it rounds once)."""
    torch.manual_seed(0)
    norm = RMSNorm(768, eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, 256, 768, device="cuda") * 4).to(dtype).requires_grad_()
    # Representable in dtype: the gradient reaching the 16-bit output is dtype's, and float32's reference gets the
    # same one. A float32 direction, rounded for the kernel only, put 0.14 between the two weight gradients (sums of
    # 1,024 rows; 17 of 768 past the tolerance on the H100, 2026-11-26): its rounding, not the kernel's error
    direction = torch.randn(4, 256, 768, device="cuda").to(dtype).float()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")  # a kernel, not ops
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recording, \
            torch.autocast("cuda", dtype=dtype, enabled=autocast):
        out = norm(x)
        torch.cuda.synchronize()
    names = {event.name for event in recording.events() if event.device_type == DeviceType.CPU}
    kernels = [event.name for event in recording.events() if event.device_type == DeviceType.CUDA]
    assert "aten::_fused_rms_norm" in names and "aten::linalg_vector_norm" not in names and out.dtype == dtype
    # vectorized: one kernel; else row moments + apply: two. The CPU's chain: 5 or more; autocast's casts: 2 more
    assert len(kernels) <= 2, kernels
    (out.float() * direction).sum().backward()

    x32, weight32 = x.detach().float().requires_grad_(), norm.weight.detach().float().requires_grad_()
    expected = F.rms_norm(x32, (768,), weight32, 1e-5)
    (expected * direction).sum().backward()
    x_chain, weight_chain = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    chain = rms_norm_in_dtype(x_chain, weight_chain, 1e-5)
    (chain.float() * direction).sum().backward()
    with torch.no_grad():
        fused = norm(x)
    for got, by_chain, reference in ((fused, chain, expected), (x.grad, x_chain.grad, x32.grad),
                                     (norm.weight.grad, weight_chain.grad, weight32.grad)):
        torch.testing.assert_close(got.float(), reference, rtol=3e-2, atol=3e-2)
        error = (got.float() - reference).norm() / reference.norm()
        assert error <= 1.05 * (by_chain.float() - reference).norm() / reference.norm()


def test_rope_in_bf16_equals_the_float32_rotation_up_to_rounding():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 16)  # q and k (head_dim 8) side by side
    rotations = rope_tables(8, torch.arange(9).expand(2, 9), 10000.0)
    expected = apply_rope(x, rotations)
    tables = RotaryTables.side_by_side(rotations, vectors_per_head=2)
    got = apply_rope(x.to(torch.bfloat16), tables)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    assert apply_rope(x.to(torch.bfloat16), tables) is not got  # the tables are reused, the result is new
    assert len(tables._interleaved) == 1  # made once for bf16, reused by every later layer
    # Rotations preserve each pair's norm.
    pairs = got.float().unflatten(-1, (-1, 2)).norm(dim=-1)
    torch.testing.assert_close(pairs, x.unflatten(-1, (-1, 2)).norm(dim=-1), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's eager 16-bit RoPE path needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_in_half_precision_on_cuda_is_the_float32_rotation_rounded_once(dtype):
    """On a GPU an eager 16-bit rotation is float32's complex multiply cast back once (forward + backward 1.31x the
    three passes in x's dtype on an H200): bit for bit the float32 rotation of the same values, rounded, forward and
    backward, on the strided view of the fused projection the model rotates; no 16-bit tables made."""
    torch.manual_seed(0)
    qkv = torch.randn(4, 512, 12, 3 * 64, device="cuda").to(dtype)
    positions = torch.arange(512, device="cuda").expand(4, 512)
    tables = RotaryTables.side_by_side(rope_tables(64, positions, 10000.0), vectors_per_head=2)
    half = qkv[..., : 2 * 64].detach().requires_grad_()
    got = apply_rope(half, tables)
    x32 = half.detach().float().requires_grad_()  # the same values: every 16-bit number is a float32 one
    expected = apply_rope(x32, tables)
    assert got.dtype == dtype and torch.equal(got, expected.to(dtype)) and not tables._interleaved
    grad = torch.randn_like(got)
    got.backward(grad)
    expected.backward(grad.float())
    assert torch.equal(half.grad, x32.grad.to(dtype))


def test_the_compiled_bf16_forward_writes_no_float32_activation():
    """Inductor computes the norms and RoPE in float32 inside fused kernels; a buffer of float32 activations in its
    code is a float32 round trip through memory (the real-pair RoPE wrote one of q and k in every layer)."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = NeoBERT(tiny(1)).to(torch.bfloat16).eval()
    ids = torch.randint(5, 1000, (2, 32))
    with torch.inference_mode():
        _, [code] = run_and_get_code(torch.compile(model, dynamic=False), ids)
    buffers = re.findall(r"empty_strided_cpu\(\(([\d, ]+)\), \([\d, ]+\), torch\.(\w+)\)", code)
    assert buffers, "no buffer found in Inductor's code: the pattern needs updating"
    sizes = {dtype: [eval(f"({shape},)") for shape, d in buffers if d == dtype] for _, dtype in buffers}
    numel = lambda shape: torch.Size(shape).numel()  # noqa: E731
    largest_float32 = max((numel(shape) for shape in sizes.get("float32", [])), default=0)
    assert largest_float32 < ids.numel() * tiny(1).hidden_size, sizes["float32"]
    assert max(numel(shape) for shape in sizes["bfloat16"]) >= ids.numel() * tiny(1).hidden_size
