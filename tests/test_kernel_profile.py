"""The kernel profile's categories (neobert.instruments.kernel_profile): real GPU kernel names and CPU operator names each
in its category, unknown names in "other" and listed; the totals per category sum to the recording's total, from a
real CPU recording of an MLM step and from (stand-in) CUDA kernel events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from neobert.instruments.kernel_profile import (ATTENTION, CATEGORIES, COMMUNICATION, COPY, ELEMENTWISE, MATMUL,
                                                MLM_LOSS, NORM, OPTIMIZER, OTHER, category_of, device_busy_us,
                                                self_times, summarise)
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

NAMES = {
    # cuBLAS on Hopper and Ampere, cuBLASLt's split-K reduction, CUTLASS
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x"
    "_cublas": MATMUL,
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": MATMUL,
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": MATMUL,
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false>(...)": MATMUL,
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(Params)": MATMUL,
    "aten::mm": MATMUL,
    "aten::addmm": MATMUL,
    # FlashAttention (flash-attn's and PyTorch's), memory-efficient attention, the CPU's SDPA
    "flash_fwd_kernel": ATTENTION,
    "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4, "
    "false, false, cutlass::bfloat16_t>, false, false, false>(pytorch_flash::Flash_bwd_params)": ATTENTION,
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": ATTENTION,
    "aten::_scaled_dot_product_flash_attention_for_cpu": ATTENTION,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": ATTENTION,
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": ATTENTION,
    # the MLM loss: eager log-softmax + NLL (the softmax kernel with its LogSoftMax epilogue), Liger's, Inductor's
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": MLM_LOSS,
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(...)": MLM_LOSS,
    "_cross_entropy_kernel": MLM_LOSS,
    "liger_cross_entropy_kernel": MLM_LOSS,
    "triton_red_fused__log_softmax_0": MLM_LOSS,
    "aten::_log_softmax": MLM_LOSS,
    "aten::nll_loss_forward": MLM_LOSS,
    "aten::_log_softmax_backward_data": MLM_LOSS,
    # norms: Liger's, PyTorch's fused RMSNorm, the eager bf16 RMSNorm's vector norm, Inductor's fused norm
    "_rms_norm_forward_kernel": NORM,
    "aten::_fused_rms_norm": NORM,
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::NormTwoOps<c10::BFloat16,"
    " float, float>, unsigned int, float, 4, 4> >(...)": NORM,
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": NORM,
    # pointwise and reductions
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
    "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, ...)": ELEMENTWISE,
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
    "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
    "unsigned int, float, 4, 4> >(...)": ELEMENTWISE,
    "_swiglu_forward_kernel": ELEMENTWISE,
    "triton_poi_fused_mul_silu_2": ELEMENTWISE,
    # on a CPU, a compiled graph's range: its self time is Inductor's generated C++ kernels (a GPU recording has their
    # CUDA kernels instead and leaves the range out, test below)
    "## Call CompiledFxGraph f27abb3vqlkidx7mjjry3jumo5kau2kud7votpthkc2v2xdo5zfk ##": ELEMENTWISE,
    "aten::mul": ELEMENTWISE,
    "aten::add_": ELEMENTWISE,
    "aten::silu_backward": ELEMENTWISE,
    # copies, casts and indexing: a cast is an elementwise kernel of a copy
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#3}, std::array<char*, 2ul>, 4, at::native::memory::LoadWithCast<1>, "
    "at::native::memory::StoreWithCast<1> >(...)": COPY,
    "Memcpy HtoD (Pageable -> Device)": COPY,
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
    "true>(...)": COPY,
    "aten::copy_": COPY,
    "aten::to": COPY,
    "aten::_to_copy": COPY,
    "aten::index_select": COPY,
    "aten::embedding_dense_backward": COPY,
    # a training loop's optimizer step: fused AdamW on a GPU and a CPU, DeepSpeed's, the foreach ops of clipping
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
    "(at::native::ADAM_MODE)1, false>, ...>(...)": OPTIMIZER,
    "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, long>, float, float, float, "
    "float, float, float, adamMode_t, float>(...)": OPTIMIZER,
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::NormType)1, float, "
    "float>, float*, int>(...)": OPTIMIZER,
    "aten::_fused_adamw_": OPTIMIZER,
    "aten::_foreach_norm": OPTIMIZER,
    # collectives: NCCL's kernels, c10d's and Gloo's operators
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": COMMUNICATION,
    "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": COMMUNICATION,
    "c10d::allreduce_": COMMUNICATION,
    "gloo:all_reduce": COMMUNICATION,
    # what no rule knows
    "aten::empty_strided": OTHER,
    "autograd::engine::evaluate_function: MmBackward0": OTHER,
}


@pytest.mark.parametrize("name", NAMES)
def test_each_name_goes_to_its_category(name):
    assert category_of(name) == NAMES[name]


def test_the_categories_sum_to_the_total_and_the_largest_unknown_names_are_listed():
    times = [("aten::mm", 5.0), ("aten::mm", 3.0), ("aten::_log_softmax", 2.0), ("aten::mul", 1.0),
             ("mystery_kernel", 4.0), ("aten::empty", 0.5), ("another_unknown", 1.5)]
    result = summarise(times, "CPU operators", steps=2, wall_us=20.0)
    assert tuple(result.self_us) == CATEGORIES and result.total_us == 17.0
    assert (result.self_us[MATMUL], result.self_us[MLM_LOSS], result.self_us[OTHER]) == (8.0, 2.0, 6.0)
    assert result.self_us[ATTENTION] == 0.0 and sum(result.share(c) for c in CATEGORIES) == pytest.approx(1)
    assert [(e.name, e.self_us, e.calls) for e in result.other_names(2)] == [("mystery_kernel", 4.0, 1),
                                                                             ("another_unknown", 1.5, 1)]
    assert [e.name for e in result.names_in(MATMUL)] == ["aten::mm"] and result.names_in(MATMUL)[0].calls == 2


def test_a_cpu_recording_of_an_mlm_step_by_category():
    config = NeoBERTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_length=16, pad_token_id=0)
    model = NeoBERTForMaskedLM(config)
    input_ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(32).reshape(2, 16) % 5 == 0, input_ids, torch.full_like(input_ids, -100))
    with profile(activities=[ProfilerActivity.CPU]) as recording:
        model(input_ids, labels=labels, masked_index=(labels.reshape(-1) != -100).nonzero().squeeze(1)).loss.backward()
    times = self_times(recording.events(), on_gpu=False)
    result = summarise(times, "CPU operators", steps=1, wall_us=1.0)
    assert result.total_us > 0 and sum(result.self_us.values()) == pytest.approx(result.total_us)
    assert result.self_us[MATMUL] > 0 and result.self_us[MLM_LOSS] > 0 and result.self_us[ATTENTION] > 0
    # each operator's self time: a parent's time is not counted again with its children's
    top_level = [e for e in recording.events() if e.cpu_parent is None and e.device_type == DeviceType.CPU]
    assert result.total_us == pytest.approx(sum(e.cpu_time_total for e in top_level))


def test_on_a_gpu_only_the_device_kernels_are_timed():
    def event(name, device_type, us, annotation=False):
        return SimpleNamespace(name=name, device_type=device_type, self_cpu_time_total=99.0,
                               time_range=SimpleNamespace(elapsed_us=lambda: us), is_user_annotation=annotation)

    events = [event("aten::mm", DeviceType.CPU, 0.0), event("cudaLaunchKernel", DeviceType.CPU, 0.0),
              event("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", DeviceType.CUDA, 30.0),
              event("flash_fwd_kernel", DeviceType.CUDA, 10.0), event("Memset (Device)", DeviceType.CUDA, 1.0),
              # a compiled graph's range on the GPU timeline, spanning the kernels above: not a kernel of its own
              event("## Call CompiledFxGraph fabc ##", DeviceType.CUDA, 41.0, annotation=True)]
    times = self_times(events, on_gpu=True)
    assert [name for name, _ in times] == ["ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
                                           "flash_fwd_kernel", "Memset (Device)"]
    result = summarise(times, "CUDA kernels", steps=1, wall_us=50.0)
    assert (result.total_us, result.self_us[MATMUL], result.self_us[ATTENTION], result.self_us[COPY]) == (
        41.0, 30.0, 10.0, 1.0)


def test_the_devices_busy_time_counts_overlapping_kernels_once():
    """Kernels of two streams at once (a collective beside the backward) are one busy stretch; the gaps between
    kernels (the device waiting for the host) are not busy; CPU operators and annotations are not the device's."""
    def event(start, end, device_type=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(device_type=device_type, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event(0, 10), event(5, 12), event(6, 8),  # overlapping: 0-12
              event(20, 25),  # after a gap of 8
              event(30, 40), event(40, 45),  # end to end
              event(0, 100, DeviceType.CPU), event(12, 30, annotation=True)]
    assert device_busy_us(events) == 12 + 5 + 15
    assert device_busy_us([]) == 0


def test_a_cpu_recording_leaves_out_record_function_ranges():
    """A record_function range's self time is the Python between its operators: a recording of a loop (which has
    them: DistributedDataParallel.forward, Optimizer.step#...) would count time a bare model's recording cannot."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    with profile(activities=[ProfilerActivity.CPU]) as recording:
        with torch.profiler.record_function("a range"):
            model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    times = dict(self_times(recording.events(), on_gpu=False))
    assert "a range" not in times and "Optimizer.step#AdamW.step" not in times
    assert {"aten::addmm", "aten::_fused_adamw_"} <= set(times)
    assert category_of("aten::_fused_adamw_") == OPTIMIZER


def test_a_cpu_recording_files_sdpas_math_path_and_its_backward_under_attention():
    """SDPA's math path (BERT's attention in training on a CPU, with dropout) runs aten::bmm and aten::_softmax, and
    its backward more of them under autograd's nodes: all of it, named after it, is attention's; a bmm of the
    model's own, and its backward, stay matmuls."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), profile(activities=[ProfilerActivity.CPU]) as recording:
        attended = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        own = torch.bmm(q.flatten(0, 1), q.flatten(0, 1).transpose(1, 2))
        (attended.sum() + own.sum()).backward()
    times = self_times(recording.events(), on_gpu=False)
    calls = {}
    for name, _ in times:
        calls[name] = calls.get(name, 0) + 1
    math = "aten::_scaled_dot_product_attention_math"
    # forward: attention's two bmm; backward: two bmm for each of them; the model's own bmm: 1 + 2
    assert calls[f"{math} > aten::bmm"] == 2 and calls[f"{math} (backward) > aten::bmm"] == 4
    assert calls["aten::bmm"] == 3
    result = summarise(times, "CPU operators", steps=1, wall_us=1.0)
    in_attention = {entry.name for entry in result.names_in(ATTENTION)}
    # its softmax is attention's by its own name (the rules' softmax), which is kept
    assert {f"{math} > aten::bmm", f"{math} (backward) > aten::bmm", "aten::_softmax"} <= in_attention
    assert "aten::bmm" in {entry.name for entry in result.names_in(MATMUL)}
